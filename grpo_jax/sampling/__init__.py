"""The KV-cache sampler: prefill then a jitted decode loop, static or with continuous batching
(decode slots refilled as rows stop). Token ids in, token ids and their log-probs out.
"""
