"""``__search``: case-insensitive substring search that PostgreSQL's trigram indexes serve.

Django's ``icontains`` on PostgreSQL is ``UPPER(col::text) LIKE UPPER('%word%')``: no index on
``col`` serves an expression of it, so the ``gin_trgm_ops`` indexes on the samples' text
(migration 0002) were never used and every search scanned the run's samples (bench/rollout_search.py:
0.5 s for a rare word over 51,200 completions). ``col ILIKE '%word%'`` is what ``gin_trgm_ops``
serves. Elsewhere (SQLite) the lookup is ``icontains`` itself. The pattern is escaped exactly as
``icontains`` escapes it (``%``, ``_`` and ``\\`` match themselves).
"""

from __future__ import annotations

from typing import Any

from django.db.models import CharField, TextField
from django.db.models.lookups import IContains


class Search(IContains):
    lookup_name = "search"

    def as_sql(self, compiler: Any, connection: Any) -> tuple[str, list[Any]]:
        if connection.vendor != "postgresql":
            return IContains(self.lhs, self.rhs).as_sql(compiler, connection)
        lhs_sql, lhs_params = compiler.compile(self.lhs)  # the column itself: no UPPER() around it
        rhs_sql, rhs_params = self.process_rhs(compiler, connection)  # '%word%', escaped as icontains does
        return f"{lhs_sql} ILIKE {rhs_sql}", [*lhs_params, *rhs_params]


TextField.register_lookup(Search)
CharField.register_lookup(Search)
