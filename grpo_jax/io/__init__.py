"""What crosses the process boundary: Hugging Face checkpoints, tokenizers and chat templates in;
Orbax checkpoints and their fingerprints, run directories (local or object storage), metrics,
scalar sinks, logged samples and plots out.
"""
