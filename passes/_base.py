"""What every pass shares: its result, the context the pipeline hands it, its error type."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mgx.formats import ir

__all__ = ["PassError", "PassResult", "PassContext", "PassFn"]


class PassError(ValueError):
    """A pass cannot run on this graph or with these options; the message says which op or option."""


@dataclass(slots=True)
class PassResult:
    """What a pass did, for the log and the artifact's pass record."""

    summary: str  # one line: ops fused, bytes before and after, ...
    stats: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] | None = None  # the options it ran with, defaults filled in (JSON-able)


@dataclass(slots=True)
class PassContext:
    """What a pass may need besides the graph and its options; the pipeline fills it in.

    Passes never import the compiler: anything computed from the source model (such as calibration
    statistics) arrives here.
    """

    target: str = "cpu"  # the build target (model.yaml `target`): whose kernels' layouts to prefer
    # Calibration statistics, present when the pass's options named a calibration text: for each
    # activation value that feeds a linear or lm_head op, the mean of x x^T over the calibration
    # tokens, [K, K] float64 (x is that value's row for one token, as the graph computes it now).
    hessians: Mapping[str, np.ndarray] | None = None
    calibration_tokens: int = 0  # tokens the statistics were averaged over


PassFn = Callable[[ir.Graph, dict[str, Any], PassContext], PassResult]
