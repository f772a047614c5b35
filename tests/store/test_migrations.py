"""Schema changes are Alembic's alone, whatever order its branches apply in (PostgreSQL)."""

from __future__ import annotations

import pytest
from sqlalchemy import create_engine, text

from store import Store
from store import control as db
from store.migrate import current_heads, head_revisions, upgrade
from store.writes import sample_row
from tests.conftest import reset_postgres
from tests.factories import sample

pytestmark = pytest.mark.postgres


def test_samples_are_numbered_in_arrival_order_whichever_branch_applied_first(
    postgres_url: str,
) -> None:
    """The control branch before the tiers branch (which rebuilds ``samples`` as a
    partitioned table, without the numbering trigger): at the heads every sample stored has
    its arrival number, and no control loop had to take over for it."""
    reset_postgres(postgres_url)
    engine = create_engine(postgres_url)
    upgrade(engine, "0003_control")
    upgrade(engine, "0003_tiers")  # rebuilds samples after the trigger was made
    upgrade(engine)
    assert current_heads(engine) == head_revisions()
    engine.dispose()
    store = Store.open(postgres_url, migrate=False)
    try:
        store.write(samples=[sample_row(sample(node="n0", gpu=gpu)) for gpu in (0, 1)])
        with store.engine.connect() as c:
            numbers = c.execute(text("SELECT arrival_seq FROM samples")).scalars().all()
            assert len(numbers) == 2 and None not in numbers
            frame, seqs = db.samples_after(c, 0)
            assert len(frame) == 2 and sorted(seqs) == sorted(numbers)
    finally:
        store.close()
