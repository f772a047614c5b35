"""The control loop's Prometheus families, from the status its last tick published."""

from __future__ import annotations

from api.metrics import control_families


def values(families) -> dict[str, float]:  # type: ignore[no-untyped-def]
    return {s.name: s.value for f in families for s in f.samples}


def test_a_loop_behind_the_fleet_says_so_on_the_leader_only() -> None:
    status = {"behind": True, "durations": {"le": [1.0], "per": [3], "count": 3, "sum": 1.5}}
    leading = values(control_families(status, leads=True, risks=[("n0", 1, 0.2)]))
    assert leading["forewarn_control_behind"] == 1.0
    assert leading["forewarn_scorer_tick_seconds_count"] == 3
    caught_up = values(control_families({"behind": False}, leads=True, risks=[]))
    assert caught_up["forewarn_control_behind"] == 0.0
    following = values(control_families(status, leads=False, risks=[]))
    assert "forewarn_control_behind" not in following
    assert following["forewarn_control_leader"] == 0.0


def test_shared_scoring_shows_its_members_their_warms_and_each_followers_lag() -> None:
    partition = {
        "member": "a:1",
        "members": ["a:1", "b:2", "c:3"],
        "warming": 171,
        "followers": {
            "b:2": {"gpus": 5, "age_s": 2.5, "merged": True, "tick_s": 1.25, "warming": 3},
            "c:3": {"age_s": 41},
        },
    }
    leading = control_families({"partition": partition}, leads=True, risks=[])
    samples = {(s.name, tuple(s.labels.values())): s.value for f in leading for s in f.samples}
    assert samples[("forewarn_scoring_members", ())] == 3
    assert samples[("forewarn_scoring_warming_buckets", ("a:1",))] == 171
    assert samples[("forewarn_scoring_warming_buckets", ("b:2",))] == 3
    assert samples[("forewarn_scoring_follower_age_seconds", ("b:2",))] == 2.5
    assert samples[("forewarn_scoring_follower_age_seconds", ("c:3",))] == 41
    assert samples[("forewarn_scoring_follower_tick_seconds", ("b:2",))] == 1.25
    assert ("forewarn_scoring_follower_tick_seconds", ("c:3",)) not in samples
    alone = values(control_families({"partition": None}, leads=True, risks=[]))
    assert "forewarn_scoring_members" not in alone
