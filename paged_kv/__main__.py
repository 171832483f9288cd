"""``python -m paged_kv``: see :mod:`paged_kv.cli`."""

from .cli import main_entry

main_entry()
