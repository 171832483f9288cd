"""``python -m paged_kv``: see :mod:`paged_kv.cli`."""

from paged_kv.cli import main_entry

main_entry()
