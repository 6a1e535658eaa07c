"""Save and keep policies."""

from __future__ import annotations

import re

import pytest

from ftrain.ckpt.policies import (
    AnyOf,
    BestN,
    EveryKSteps,
    EveryNSeconds,
    EveryNSteps,
    KeepAll,
    LatestN,
    SaveContext,
    StepInfo,
    YoungerThan,
    best_policies,
)


def ctx(step, now=100.0, last_step=None, last_time=None):
    return SaveContext(step, now, last_step, last_time)


def infos():
    losses = {10: 3.0, 20: 1.0, 30: 2.0, 40: float("nan"), 50: 1.5}
    return [
        StepInfo(s, float(s), {"val_loss": v} if s != 30 else {"val_loss": v, "acc": 0.9})
        for s, v in losses.items()
    ]


def test_save_policies():
    assert EveryNSteps(100).should_save(ctx(200)) and not EveryNSteps(100).should_save(ctx(250))
    p = EveryNSeconds(60)
    assert (
        p.should_save(ctx(1))
        and not p.should_save(ctx(2, 100, 1, 50))
        and p.should_save(ctx(3, 111, 2, 50))
    )
    both = AnyOf(EveryNSteps(100), EveryNSeconds(60))
    assert both.should_save(ctx(7, 200, 5, 100)) and not both.should_save(ctx(7, 120, 5, 100))


def test_keep_policies():
    i = infos()
    assert LatestN(2).keep(i, 0) == {40, 50}
    assert EveryKSteps(20).keep(i, 0) == {20, 40}
    assert BestN("val_loss", 2).keep(i, 0) == {20, 50}  # nan is never "best"
    assert BestN("val_loss", 1, mode="max").keep(i, 0) == {10}
    assert BestN("acc", 3).keep(i, 0) == {30}
    assert YoungerThan(25).keep(i, 60) == {40, 50}
    assert KeepAll().keep(i, 0) == {10, 20, 30, 40, 50}
    composed = AnyOf(LatestN(1), EveryKSteps(30), BestN("val_loss", 1))
    assert composed.keep(i, 0) == {50, 30, 20}
    assert [b.metric for b in best_policies(AnyOf(LatestN(1), composed))] == ["val_loss"]


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: EveryNSteps(0), "n=0"),
        (lambda: LatestN(-1), "n=-1"),
        (lambda: EveryNSeconds(0), "seconds=0"),
        (lambda: BestN("x", 1, mode="avg"), "mode='avg'"),
        (lambda: AnyOf(), "at least one"),
        (lambda: LatestN(1.5), "must be a whole number, got n=1.5"),
        (lambda: EveryKSteps(True), "must be a whole number"),
        (lambda: BestN(3, 2), "got metric=3 .BestN.metric, n.: the name comes first"),
        (lambda: BestN("", 2), "got metric=''"),
    ],
)
def test_bad_arguments_name_the_value(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_a_policy_in_the_wrong_place_is_refused_at_the_manager(tmp_path):
    """EveryNSteps as the keep policy (for EveryKSteps) committed step 1, then failed in
    the background, and the next save raised over a committed step."""
    from ftrain.ckpt import CheckpointManager

    for kw, said in (
        ({"keep_policy": EveryNSteps(2)}, "keep_policy=EveryNSteps(n=2) has no keep()"),
        ({"save_policy": LatestN(2)}, "save_policy=LatestN(n=2) has no should_save()"),
        ({"keep_policy": AnyOf(LatestN(1), EveryNSteps(2))}, "EveryNSteps(n=2) has no keep()"),
        # the class for an instance: keep() unbound failed at every commit, index never written
        (
            {"keep_policy": KeepAll},
            "keep_policy=KeepAll is a class: pass an instance, e.g. KeepAll()",
        ),
        ({"keep_policy": AnyOf(LatestN(1), LatestN)}, "keep_policy=LatestN is a class"),
    ):
        with pytest.raises(TypeError, match=re.escape(said)):
            CheckpointManager(tmp_path / "ck", **kw)
    CheckpointManager(tmp_path / "ck", keep_policy=AnyOf(LatestN(1), EveryKSteps(2))).close()


def test_a_keep_policy_that_raises_is_a_warning_not_a_lost_save(tmp_path):
    """The step is committed; the next save must not fail over retention."""
    import torch
    from tensordict import TensorDict

    from ftrain.ckpt import CheckpointManager

    class Broken:
        def keep(self, infos, now):
            raise TypeError("my policy's bug")

    with CheckpointManager(tmp_path / "ck", keep_policy=Broken(), async_save=True) as m:
        with pytest.warns(RuntimeWarning, match="retention or the index failed: .*my policy's bug"):
            for step in (1, 2):
                m.save(TensorDict(step=torch.tensor(step), w=torch.ones(3)), force=True)
            m.wait()
        assert m.all_steps() == [1, 2]


def test_a_lone_best_n_whose_metric_no_step_has_deletes_nothing_and_says_so(tmp_path, caplog):
    """A misspelt metric (or metrics never passed to save) ranked no step: every step but
    the newest was deleted, the best among them, with no word."""
    import logging

    import torch
    from tensordict import TensorDict

    from ftrain.ckpt import CheckpointManager, policies

    policies._SAID.clear()
    losses = [5.0, 4.0, 0.1, 2.0, 1.0]
    typo = CheckpointManager(tmp_path / "ck", keep_policy=BestN("val_los", 2))
    with caplog.at_level(logging.WARNING), typo as m:
        for step, loss in enumerate(losses, start=1):
            m.save(TensorDict(step=torch.tensor(step)), force=True, metrics={"val_loss": loss})
        m.wait()
        assert m.all_steps() == [1, 2, 3, 4, 5]
    said = [r.getMessage() for r in caplog.records if "val_los'" in r.getMessage()]
    assert len(said) == 2, said  # nothing deleted; and the close name, each once
    assert any("ranks no committed step (none has a finite 'val_los'" in m for m in said)
    assert any("but they have 'val_loss': is that the metric meant?" in m for m in said)
    # once a step has it, ranking resumes: the best 2 and the newest are kept
    with CheckpointManager(tmp_path / "ck", keep_policy=BestN("val_loss", 2)) as m:
        m.save(TensorDict(step=torch.tensor(6)), force=True, metrics={"val_loss": 3.0})
        m.wait()
        assert m.all_steps() == [3, 5, 6]


def test_best_n_beside_other_policies_ranks_nothing_before_its_metric_and_keeps_it_bounded():
    """With LatestN beside it, a BestN whose metric is not reported yet (the command line's
    val_loss before the first evaluation) keeps nothing itself: retention stays bounded.
    A metric only far from the steps' names (val_loss beside loss) is not warned about."""
    from ftrain.ckpt import policies

    policies._SAID.clear()
    steps = [StepInfo(s, float(s), {"loss": 1.0 / s}) for s in range(1, 51)]
    composed = AnyOf(LatestN(2), BestN("val_loss", 1))
    assert composed.keep(steps, 0) == {49, 50}
    assert not policies.ranks_nothing(composed, steps) and not policies._SAID
    assert policies.ranks_nothing(BestN("val_loss", 1), steps)
    assert not policies.ranks_nothing(BestN("loss", 1), steps)
