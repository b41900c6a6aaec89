"""Summaries of repeated timings: the median and how far the samples spread around it."""

from __future__ import annotations

import statistics


def spread(samples: list[float]) -> dict:
    """Median, quartiles and extremes of `samples`, and their spreads as % of the median.

    iqr_pct is (p75 - p25) / median, range_pct (max - min) / median; quartiles interpolate
    between samples (statistics.quantiles, inclusive), so one sample has no spread.
    """
    if not samples:
        raise ValueError("spread of no samples")
    median = statistics.median(samples)
    p25, p75 = (statistics.quantiles(samples, n=4, method="inclusive")[::2]
                if len(samples) > 1 else (median, median))
    low, high = min(samples), max(samples)
    return {
        "n": len(samples),
        "median": median,
        "p25": p25,
        "p75": p75,
        "min": low,
        "max": high,
        "iqr_pct": 100 * (p75 - p25) / median if median else 0.0,
        "range_pct": 100 * (high - low) / median if median else 0.0,
    }


def scaled(summary: dict, factor: float) -> dict:
    """`summary` (from spread) in other units: the times multiplied, the percentages kept."""
    return {key: value * factor if key in ("median", "p25", "p75", "min", "max") else value
            for key, value in summary.items()}


def slowest(per_rank: list[list[float]]) -> list[float]:
    """Sample by sample, the slowest rank's: a step ends when its last rank is done."""
    return [max(samples) for samples in zip(*per_rank, strict=True)]


def paired_ratios(ours: list[float], reference: list[float]) -> dict:
    """Round by round `ours / reference`, and the spread of those ratios.

    Each round ran both back to back, so a drift of the machine between rounds cancels.
    """
    ratios = [a / b for a, b in zip(ours, reference, strict=True)]
    return {"ratios": ratios, **spread(ratios)}
