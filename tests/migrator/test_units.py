"""In-process tests of the parts: state listing, in-place transfer, data position, faults."""

from __future__ import annotations

import pickle
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from forewarn.errors import MigrationError
from migrator import protocol as P
from migrator.data import ShardedIndices
from migrator.faults import FaultPlan
from migrator.groups import c10d_store, new_group, pair_group
from migrator.state import Registry, capture_rank_state, restore_rank_state
from migrator.transport import PGTransport


def _trained(seed: int) -> Registry:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        sched.step()
    return Registry(models=[model], optimizers=[opt], schedulers=[sched])


def _master() -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20)
    )


def _client(master: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=20))


def test_c10d_stores_are_kv_stores_and_take_bytes() -> None:
    """``as_kv_store`` casts past torch's stub (``set`` typed str, no ``multi_set``): the real
    stores have every :class:`KVStore` method and keep the bytes the mirrors are."""
    members = [name for name in vars(P.KVStore) if not name.startswith("_")]
    assert "multi_set" in members and "set" in members
    for store in (_master(), dist.HashStore()):
        kv = P.as_kv_store(dist.PrefixStore("p", store))
        assert all(callable(getattr(kv, name)) for name in members)
        kv.set("a", b"\xff\x00")
        kv.multi_set(["b", "c"], [b"\x80", "z"])
        assert kv.multi_get(["a", "b", "c"]) == [b"\xff\x00", b"\x80", b"z"]
        assert kv.get("a") == b"\xff\x00"
        assert kv.add("n", 2) == 2 and kv.add("n", 0) == 2
        assert kv.check(["a", "n"]) and kv.delete_key("a") and not kv.check(["a"])
        assert c10d_store(kv) is kv
    with pytest.raises(TypeError, match="c10d store"):
        c10d_store(object())


def test_transfer_lands_in_place_and_equal() -> None:
    src, dst = _trained(1), _trained(2)
    dst.optimizers[0].state.clear()  # a spare's optimizer has no state yet
    store = _master()
    weight = dst.models[0][0].weight
    ptr = weight.data_ptr()
    got: dict[str, object] = {}

    def receive() -> None:
        group = pair_group(_client(store), "x", sender=False, backend="gloo", timeout_s=10)
        meta, stats = PGTransport(group).recv(lambda m: dst.prepare(m["manifest"]), timeout_s=10)
        dst.apply_meta(meta)
        got["bytes"] = stats.bytes

    t = threading.Thread(target=receive)
    t.start()
    group = pair_group(_client(store), "x", sender=True, backend="gloo", timeout_s=10)
    PGTransport(group).send(src.meta(), [x for _, x in src.tensors()], timeout_s=10)
    t.join(timeout=30)
    assert not t.is_alive()
    assert weight.data_ptr() == ptr, "parameters must be received in place"
    for (n, a), (m, b) in zip(src.tensors(), dst.tensors(), strict=True):
        assert n == m and torch.equal(a, b)
    assert dst.schedulers[0].state_dict() == src.schedulers[0].state_dict()
    assert dst.optimizers[0].param_groups[0]["lr"] == src.optimizers[0].param_groups[0]["lr"]
    assert int(got["bytes"]) >= src.nbytes()  # type: ignore[call-overload]


def test_mismatched_model_is_refused() -> None:
    src = _trained(1)
    other = Registry(models=[torch.nn.Linear(4, 7)])
    with pytest.raises(MigrationError, match="sender has"):
        other.prepare(src.manifest())


def test_state_allocated_ahead_is_what_the_transfer_lands_in() -> None:
    src, dst = _trained(1), _trained(2)
    dst.optimizers[0].state.clear()  # a spare's optimizer has no state yet
    manifest = src.manifest()
    opt_bytes = sum(t.numel() * t.element_size() for n, t in src.tensors() if n.startswith("opt"))
    assert dst.preallocate(manifest) == opt_bytes
    assert not dst.optimizers[0].state, "allocated aside, not into the optimizer"
    ahead = {name: t.data_ptr() for name, t in dst.ahead.items()}
    dsts = dst.prepare(manifest)
    assert not dst.ahead, "prepare takes what was set aside"
    landed = {n: t.data_ptr() for (n, _, _), t in zip(manifest, dsts, strict=True)}
    assert ahead and all(landed[n] == ptr for n, ptr in ahead.items())

    # A manifest that changed since (another shape) gets fresh state, not the stale one.
    dst.optimizers[0].state.clear()
    stale = [(n, (1,) if n.endswith("exp_avg") else s, d) for n, s, d in manifest]
    dst.preallocate(stale)
    dsts = dst.prepare(manifest)
    for (n, shape, _), t in zip(manifest, dsts, strict=True):
        assert tuple(t.shape) == shape, n

    # A manifest of another optimizer is refused with the names, not an IndexError.
    with pytest.raises(MigrationError, match="no optimizer 1"):
        Registry(models=dst.models, optimizers=dst.optimizers).preallocate(
            [("opt1.p0.exp_avg", (6, 4), "torch.float32")]
        )


def test_a_waiting_spare_allocates_the_published_state_and_receives_into_it() -> None:
    """Rank 0 publishes its manifest once Adam has state; a spare waiting for its assignment
    allocates that state then, and the handover's transfer lands in that very memory."""
    from migrator import Job
    from migrator import protocol as P

    store = _master()

    def job(slot: int, rank: int | None) -> tuple[Job, torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        j = Job(kv=_client(store), slot=slot, world_size=1, initial_rank=rank, timeout_s=10)
        j.register(model=model, optimizer=opt)
        return j, model, opt

    src, model, opt = job(0, 0)
    for step in src.steps(2):  # the manifest is published at boundary 1, after Adam's first step
        with step:
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert store.check([P.MANIFEST_KEY])

    spare, _, spare_opt = job(1, None)
    got: dict[str, object] = {}
    waiting = threading.Thread(target=lambda: got.update(step=spare.handover.serve_as_spare()))
    waiting.start()
    for _ in range(500):
        if spare.handover.ahead_bytes:
            break
        threading.Event().wait(0.01)
    adam_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    assert spare.handover.ahead_bytes == adam_bytes
    ahead = {name: t.data_ptr() for name, t in spare.registry.ahead.items()}

    P.put_json(store, P.assign_key(1), {"mode": "peer", "migration_id": "m", "rank": 0, "gen": 1})
    src.handover._send("x/m/peer", step=2, rank_state=capture_rank_state(2, None))
    waiting.join(timeout=30)
    assert got == {"step": 2}
    landed = dict(spare.registry.tensors())
    assert {n: landed[n].data_ptr() for n in ahead} == ahead, (
        "received into the state allocated ahead"
    )
    for (n, a), (m, b) in zip(src.registry.tensors(), spare.registry.tensors(), strict=True):
        assert n == m and torch.equal(a, b), n
    assert spare_opt.state_dict()["state"][0]["step"] == opt.state_dict()["state"][0]["step"]
    src.commands.close()
    spare.commands.close()

    # A manifest this spare cannot hold (another optimizer) is logged and left: the spare
    # keeps waiting, and a handover would refuse the mismatch as before.
    other, _, _ = job(2, None)
    store.set(P.MANIFEST_KEY, pickle.dumps([("opt1.p0.exp_avg", (6, 4), "torch.float32")]))
    other.handover._allocate_ahead()
    assert other.handover.ahead_bytes == 0 and not other.registry.ahead


def test_ddp_bucket_plan_is_kept_once_ddp_settled_it() -> None:
    from migrator.ddp import ElasticDDP

    store = _master()
    group = new_group(store, "ddp", rank=0, size=1, backend="gloo", timeout_s=10)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    wrapped = ElasticDDP(model, bucket_cap_mb=0.0001)
    wrapped.rebuild(group, None, initial=True)
    wrapped.settle()
    assert wrapped._plan is None, "not before DDP rebuilt its buckets"
    first = wrapped.bucket_plan()
    for _ in range(2):  # DDP rebuilds its buckets in the forward after the first backward
        wrapped(torch.randn(2, 8)).sum().backward()
    wrapped.settle()
    assert wrapped._plan is not None
    assert wrapped.bucket_plan() == wrapped._read_plan()
    assert sorted(i for b in wrapped.bucket_plan() or [] for i in b) == sorted(
        i for b in first or [] for i in b
    )
    wrapped.rebuild(group, wrapped.bucket_plan())
    assert wrapped._plan is None, "a rebuilt DDP is read afresh"


def test_rank_state_round_trip_restores_every_rng() -> None:
    import random

    import numpy as np

    data = ShardedIndices(100, 4, rank=1, world_size=2)
    data.next()
    blob = capture_rank_state(7, data)
    expect = (random.random(), np.random.rand(), torch.rand(1), data.next())
    data2 = ShardedIndices(100, 4, rank=0, world_size=2)
    assert restore_rank_state(blob, data2) == 7
    got = (random.random(), np.random.rand(), torch.rand(1), data2.next())
    assert expect[0] == got[0] and expect[1] == got[1]
    assert torch.equal(expect[2], got[2]) and torch.equal(expect[3], got[3])


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(16, 200),
    batch=st.integers(1, 8),
    world=st.integers(1, 3),
    cut=st.integers(0, 40),
)
def test_sharded_indices_resume_anywhere(n: int, batch: int, world: int, cut: int) -> None:
    if n < batch * world:
        return
    a = ShardedIndices(n, batch, rank=world - 1, world_size=world, seed=3)
    for _ in range(cut):
        a.next()
    b = ShardedIndices(n, batch, rank=0, world_size=world, seed=3)
    b.load_state_dict(a.state_dict())
    for _ in range(5):
        assert torch.equal(a.next(), b.next())


def test_fault_plan_json_and_once_per_job() -> None:
    plan = FaultPlan().fail_at(1, 3, where="backward").migrate_at(0, 2, reason="preventive")
    again = FaultPlan.from_json(plan.to_json())
    assert again == plan
    assert [f.kind for _, f in again.due("backward", 1, 3)] == ["kill"]
    assert again.due("backward", 0, 3) == []

    calls: list[tuple[int, str]] = []

    class Job:
        def request_migration(self, rank: int, reason: str) -> None:
            calls.append((rank, reason))

    store = dist.HashStore()
    for _ in range(3):
        again.fire("step_start", 0, 2, kv=store, job=Job())
    assert calls == [(0, "preventive")]


def test_checkpoint_round_trip_is_atomic_and_restores_in_place(tmp_path: Path) -> None:
    from migrator import checkpoint

    src, dst = _trained(1), _trained(2)
    dst.optimizers[0].state.clear()
    data = ShardedIndices(100, 4, rank=1, world_size=2)
    data.next()
    states = {0: capture_rank_state(5, None), 1: capture_rank_state(5, data)}
    path = checkpoint.write(tmp_path, step=5, registry=src, rank_states=states, bucket_plans=[])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", path.name]  # no temp left
    expect = data.next()
    weight = dst.models[0][0].weight
    ptr = weight.data_ptr()
    dst.data = ShardedIndices(100, 4, rank=0, world_size=2)
    assert checkpoint.restore(checkpoint.load(tmp_path), dst, 1) == 5
    assert weight.data_ptr() == ptr
    for (n, a), (m, b) in zip(src.tensors(), dst.tensors(), strict=True):
        assert n == m and torch.equal(a, b)
    assert dst.schedulers[0].state_dict() == src.schedulers[0].state_dict()
    assert torch.equal(dst.data.next(), expect)
    with pytest.raises(checkpoint.CheckpointError, match="2 ranks"):
        checkpoint.restore(checkpoint.load(path), dst, 2)
    with pytest.raises(checkpoint.CheckpointError, match="at step 5, not 6"):
        checkpoint.write(tmp_path, step=6, registry=src, rank_states=states, bucket_plans=[])


def test_modules_sharded_on_their_group_are_refused_at_registration() -> None:
    """FSDP1, FSDP2 applied by the script itself (not through ``job.fsdp``) and DTensor
    tensor parallelism are bound to the group they were wrapped on: the migrator says so at
    registration instead of failing at the first move. ``job.fsdp`` modules are accepted
    (tests/migrator/test_fsdp.py)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy, fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from migrator.state import refuse_bound_sharding

    refuse_bound_sharding([torch.nn.Linear(4, 2)])  # replicated: accepted
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        fully_shard(sharded, mesh=mesh)
        with pytest.raises(MigrationError, match=r"FSDP2 module not sharded by job\.fsdp") as err:
            refuse_bound_sharding([torch.nn.Linear(2, 2), sharded])
        assert err.value.details["model"] == 1
        assert "job.fsdp(module" in str(err.value)
        refuse_bound_sharding([sharded], fsdp=[sharded])  # sharded by job.fsdp: accepted
        fsdp1 = FullyShardedDataParallel(
            torch.nn.Linear(4, 2),
            device_id=torch.device("cpu"),
            sharding_strategy=ShardingStrategy.NO_SHARD,  # what one rank gets anyway
        )
        with pytest.raises(MigrationError, match="FSDP1 FullyShardedDataParallel"):
            refuse_bound_sharding([fsdp1])
        tp = torch.nn.Linear(4, 2)
        tp.weight = torch.nn.Parameter(distribute_tensor(tp.weight.detach(), mesh, [Shard(0)]))
        with pytest.raises(MigrationError, match=r"DTensor parameter \(weight\)") as err:
            refuse_bound_sharding([tp])
        assert "tensor parallelism is not supported" in str(err.value)
    finally:
        dist.destroy_process_group()


def test_a_capture_reusing_what_did_not_change_equals_a_full_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The job's capture reads each generator in place and encodes again only what changed;
    after every kind of draw it must equal a capture made from scratch, byte for byte. The
    draws that change no raw state are the traps: NumPy and Python hand out a cached
    Gaussian without drawing."""
    import random

    import numpy as np

    from migrator.state import RankStateCapture, peek_step

    data = ShardedIndices(100, 4, rank=0, world_size=1)
    draws = [
        lambda: None,
        random.random,
        lambda: random.gauss(0, 1),  # caches its pair's second value
        lambda: random.gauss(0, 1),  # hands the cached one out: Python's raw state unchanged
        np.random.rand,
        np.random.randn,  # caches a Gaussian
        np.random.randn,  # hands it out: the Mersenne Twister's raw state unchanged
        lambda: None,
        lambda: torch.rand(1),
        data.next,
        lambda: np.random.seed(5),
        lambda: random.seed(5),
    ]
    for fallback in (False, True):
        if fallback:  # an interpreter whose random generator cannot be read in place
            monkeypatch.setattr("migrator.state._PyRandomView.read", lambda self: None)
        capture = RankStateCapture()
        for k, draw in enumerate(draws * 2):
            draw()
            blob = capture.capture(k, data)
            assert blob == capture_rank_state(k, data), f"after draw {k % len(draws)}"
            assert peek_step(blob) == k
    original = np.random.get_bit_generator()
    try:  # a global NumPy generator that is not a Mersenne Twister: read through get_state
        np.random.set_bit_generator(np.random.PCG64(3))
        capture = RankStateCapture()
        for k in range(3):
            np.random.rand()
            assert capture.capture(k, None) == capture_rank_state(k, None)
        # a new Mersenne Twister in its place: read in place again, through the new one
        np.random.set_bit_generator(np.random.MT19937(0))
        blob = capture.capture(3, None)
        assert blob == capture_rank_state(3, None)
        expect = np.random.rand()
        assert restore_rank_state(blob, None) == 3 and np.random.rand() == expect
    finally:
        np.random.set_bit_generator(original)


def test_a_rank_state_in_the_format_before_the_head_is_read() -> None:
    """Checkpoints written before the head held each rank's state as one pickled dict."""
    import random

    import numpy as np

    from migrator.state import peek_step

    version, mt, gauss = random.getstate()
    import array

    old = pickle.dumps(
        {
            "step": 9,
            "python": (version, array.array("Q", mt).tobytes(), gauss),
            "numpy": np.random.get_state(legacy=False),
            "torch": torch.get_rng_state().numpy().tobytes(),
            "cuda": None,
            "data": None,
        }
    )
    expect = (random.random(), np.random.rand(), torch.rand(1))
    assert peek_step(old) == 9 and restore_rank_state(old, None) == 9
    assert (random.random(), np.random.rand()) == expect[:2]
    assert torch.equal(torch.rand(1), expect[2])


@pytest.mark.parametrize("draw_after", [False, True])
def test_the_state_mirror_is_one_write_a_step_unless_the_script_draws_after_its_collectives(
    draw_after: bool,
) -> None:
    """The state at boundary k+1 is mirrored inside step k, before its collectives; the
    boundary writes it again only if random numbers were drawn after them. Either way the
    mirror read for every boundary is that boundary's state."""
    from migrator import Job
    from migrator.handover import mirror_at

    store = _master()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    job = Job(kv=store, slot=0, world_size=1, initial_rank=0, timeout_s=10)
    job.register(model=model, optimizer=opt)
    net = job.ddp(model)
    writes: list[str] = []
    real = job.kv

    class Counting:
        def __getattr__(self, name: str) -> object:
            return getattr(real, name)

        def set(self, key: str, value: bytes) -> None:
            writes.append(key)
            real.set(key, value)

        def multi_set(self, keys: list[str], values: list[bytes]) -> None:
            writes.extend(keys)
            real.multi_set(keys, values)

    job.kv = Counting()  # type: ignore[assignment]
    boundaries: dict[int, bytes] = {}
    for step in job.steps(6):
        with step:
            boundaries[step.index] = job._snapshot  # type: ignore[assignment]
            if step.index > 0:
                assert mirror_at(real, 0, step.index) == boundaries[step.index]
            net(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            if draw_after:
                torch.rand(1)
    mirrors = [k for k in writes if k.startswith("rs/")]
    # Step 0's boundary has nothing written ahead; then one write a step (two with draws).
    assert len(mirrors) == (1 + 6 + 5 if draw_after else 1 + 6), mirrors
