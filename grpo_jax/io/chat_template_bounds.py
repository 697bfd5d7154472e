"""Bounds on rendering a chat template: templates arrive inside downloaded checkpoints, and the
sandbox (`ImmutableSandboxedEnvironment`) keeps them away from Python but not from the CPU or the
memory. Found by the fault probe of issue 30: two nested ``range(100000)`` loops or
``10 ** (10 ** 8)`` ran for over 20 s, ``'x' * 10**10`` or 1 GB of loop output ran until the
process died of memory.

What is bounded in one render (`RenderLimits`; `model.chat_template_max_seconds` and
`model.chat_template_max_chars` raise the first two):
- time: ``max_seconds`` of wall time (2 s; a real template renders in well under 10 ms). A watchdog
  thread raises `TemplateTimeout` inside the rendering thread at the next Python bytecode (every
  loop Jinja compiles is Python code; the single big C operations are stopped by the guards below);
- output and every value built: ``max_chars`` characters (4,000,000; a 32k-token prompt is ~150 KB),
  checked on the output as it streams, on the result of ``*``, ``+``, every call and filter, and on
  what a ``namespace`` attribute is set to; a call argument or a format width above it is refused
  before the allocation (``'x'.ljust(10**9)``, ``'{:>999999999}'.format(1)``);
- powers and products of integers: results of at most ``max_int_bits`` bits (4096), refused before
  Python computes them (``10 ** (10 ** 8)`` would take minutes in C, where no watchdog reaches);
- ``range``: at most 100,000 items a call (the sandbox's own bound) and ``max_range_items``
  (1,000,000) over the render, so nested loops are refused before the watchdog is needed.
Every breach is a `TemplateBoundError`; `grpo_jax.io.chat_template` turns it (and any other failure,
a RecursionError from a recursive macro included) into a ChatTemplateError naming the file.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import math
import re
import threading
from collections.abc import Iterator
from typing import Any


@dataclasses.dataclass(frozen=True)
class RenderLimits:
    max_seconds: float = 2.0
    max_chars: int = 4_000_000
    max_int_bits: int = 4096
    max_range_items: int = 1_000_000

    def __post_init__(self):
        if not (self.max_seconds > 0 and math.isfinite(self.max_seconds)):
            raise ValueError(f"chat template max_seconds must be a positive number, got {self.max_seconds}")
        for name in ("max_chars", "max_int_bits", "max_range_items"):
            if getattr(self, name) < 1:
                raise ValueError(f"chat template {name} must be >= 1, got {getattr(self, name)}")


DEFAULT_LIMITS = RenderLimits()


class TemplateBoundError(Exception):
    """A render went past one of its `RenderLimits`."""


class TemplateTimeout(BaseException):
    """Raised inside the rendering thread by the watchdog (BaseException: Jinja and the template's
    own code catch Exception in places, and must not swallow the stop)."""


_active = threading.local()  # .limits and .range_left of the render running on this thread


def _limits() -> RenderLimits:
    return getattr(_active, "limits", DEFAULT_LIMITS)


_WIDE_FORMAT = re.compile(r"\d{7,}")  # a width or precision of a million or more


def check_size(value: Any, what: str) -> Any:
    """`value` itself, after checking that a string, list, tuple or dict in it is not too long."""
    limit = _limits().max_chars
    if isinstance(value, (str, bytes, list, tuple, dict)) and len(value) > limit:
        raise TemplateBoundError(f"{what} is {len(value):,} long, over the limit of {limit:,} "
                                 "(model.chat_template_max_chars)")
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > _limits().max_int_bits:
        raise TemplateBoundError(f"{what} is an integer of {value.bit_length():,} bits, over the limit of "
                                 f"{_limits().max_int_bits:,}")
    return value


def check_arguments(args: tuple, kwargs: dict, what: str) -> None:
    """Refuses an argument that would make a call allocate more than `max_chars` (widths, counts)."""
    limit = _limits().max_chars
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > limit:
            raise TemplateBoundError(f"{what} was given the number {value}, over the limit of {limit:,} "
                                     "(model.chat_template_max_chars)")
        check_size(value, f"an argument of {what}")


def check_format_string(text: str, what: str) -> None:
    if isinstance(text, str) and _WIDE_FORMAT.search(text):
        raise TemplateBoundError(f"{what}: a format string with a width of a million or more")


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Before Python computes ``left <operator> right``: refuses results over the limits."""
    lim = _limits()
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (left, right))
    if operator == "**" and ints and right > 0 and abs(left) > 1:
        bits = right * math.log2(abs(left))
        if bits > lim.max_int_bits:
            raise TemplateBoundError(f"{left} ** {right} would have about {bits:,.0f} bits, over the limit of "
                                     f"{lim.max_int_bits:,}")
    elif operator == "*":
        if ints and left.bit_length() + right.bit_length() > lim.max_int_bits:
            raise TemplateBoundError(f"a product of integers of {left.bit_length()} and {right.bit_length()} bits "
                                     f"is over the limit of {lim.max_int_bits:,}")
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int) and len(seq) * n > lim.max_chars:
                raise TemplateBoundError(f"repeating a value of length {len(seq):,} {n:,} times is over the "
                                         f"limit of {lim.max_chars:,} (model.chat_template_max_chars)")
    elif operator == "+" and all(isinstance(v, (str, list, tuple)) for v in (left, right)):
        if len(left) + len(right) > lim.max_chars:
            raise TemplateBoundError(f"joining values of length {len(left):,} and {len(right):,} is over the "
                                     f"limit of {lim.max_chars:,} (model.chat_template_max_chars)")
    elif operator == "%":
        check_format_string(left, "the % operator")


def bounded_range(*args: int) -> range:
    """The template's ``range``: the sandbox's 100,000 items a call, and `max_range_items` a render."""
    from jinja2.sandbox import safe_range

    items = safe_range(*args)
    left = getattr(_active, "range_left", DEFAULT_LIMITS.max_range_items) - len(items)
    if left < 0:
        raise TemplateBoundError(f"the template's range() calls add up to more than "
                                 f"{_limits().max_range_items:,} items in one render")
    _active.range_left = left
    return items


def _raise_in(thread_id: int) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(TemplateTimeout))


@contextlib.contextmanager
def bounded(limits: RenderLimits) -> Iterator[None]:
    """Runs the body (one render) under `limits` on this thread. Past ``max_seconds`` a watchdog
    raises TemplateTimeout in it; the flag under the lock makes sure the exception is never
    delivered once the body has left (it would surface in the caller's unrelated code)."""
    previous = (getattr(_active, "limits", None), getattr(_active, "range_left", None))
    _active.limits, _active.range_left = limits, limits.max_range_items
    lock, state = threading.Lock(), {"done": False, "fired": False}
    target = threading.get_ident()

    def fire():
        with lock:
            if not state["done"]:
                state["fired"] = True
                _raise_in(target)

    timer = threading.Timer(limits.max_seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        try:
            yield
        finally:
            with lock:
                state["done"] = True
            timer.cancel()
    finally:
        _active.limits, _active.range_left = previous
