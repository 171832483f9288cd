"""Progress bars for long runs (lessons 07, 09, 11): tqdm, imported only when a bar is asked for."""

from __future__ import annotations


def progress_bar(total: int, name: str, unit: str = "request"):
    """A ``tqdm.auto`` bar of ``total`` items: a widget in a notebook, text in a terminal."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=name, unit=unit)
