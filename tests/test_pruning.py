"""Structured pruning: the channels each rule keeps on a hand-built model, residual groups kept aligned,
and the pruned model computing exactly what the original computes with the removed channels masked."""

from __future__ import annotations

import numpy as np
import pytest
import tf_keras as keras

from conftest import masked_copy
from qatpipe.errors import ModelFileError, SpecError
from qatpipe.pruning import prune_model
from qatpipe.pruning.criteria import equalize, filter_scores, kept_channels
from qatpipe.spec import PruneSpec

# per-filter L2 norms set by hand (each conv's largest is 1, so the "max" normaliser leaves them as they are)
NORMS_A = [1.0, 0.05, 0.5, 0.02, 0.9, 0.3, 0.08, 0.6]
NORMS_B = [1.0, 0.01, 0.01, 0.5, 0.01, 0.01, 0.2, 0.01]
NORMS_S = [0.04, 0.9, 0.01, 1.0, 0.01, 0.01, 0.01, 0.01]


def _kernel_with_norms(shape, norms, rng):
    kernel = rng.choice([-1.0, 1.0], size=shape)
    per_filter = np.sqrt(np.prod(shape[:-1]))
    return (kernel * np.asarray(norms) / per_filter).astype(np.float32)


def residual_model(seed=0) -> keras.Model:
    """in -> conv_a/bn/relu -> conv_b/bn --+--> add -> relu -> head (the output)
       in -> conv_s/bn ---------------------+"""
    rng = np.random.default_rng(seed)
    inp = keras.Input((8, 8, 3), name="in")
    a = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="conv_a")(inp)
    a = keras.layers.BatchNormalization(name="bn_a")(a)
    a = keras.layers.Activation("relu", name="relu_a")(a)
    b = keras.layers.Conv2D(8, 3, padding="same", use_bias=False, name="conv_b")(a)
    b = keras.layers.BatchNormalization(name="bn_b")(b)
    s = keras.layers.Conv2D(8, 1, use_bias=False, name="conv_s")(inp)
    s = keras.layers.BatchNormalization(name="bn_s")(s)
    r = keras.layers.Activation("relu", name="relu")(keras.layers.Add(name="add")([b, s]))
    head = keras.layers.Conv2D(2, 1, name="head")(r)
    model = keras.Model(inp, head, name="residual")
    for name, norms in (("conv_a", NORMS_A), ("conv_b", NORMS_B), ("conv_s", NORMS_S)):
        layer = model.get_layer(name)
        layer.set_weights([_kernel_with_norms(layer.kernel.shape, norms, rng)])
    for name in ("bn_a", "bn_b", "bn_s"):  # non-trivial BN so copying its per-channel weights matters
        layer = model.get_layer(name)
        layer.set_weights([rng.uniform(0.5, 1.5, 8), rng.normal(0, 0.5, 8), rng.normal(0, 0.2, 8),
                           rng.uniform(0.5, 2.0, 8)])
    model.get_layer("head").set_weights([rng.normal(0, 1, (1, 1, 8, 2)), rng.normal(0, 1, 2)])
    return model


def _settings(**kwargs):
    return PruneSpec(**{"threshold": 0.1, "granularity": 2, "min_filters": 2, **kwargs})


def _filters(model):
    return {name: model.get_layer(name).filters for name in ("conv_a", "conv_b", "conv_s", "head")}


@pytest.mark.parametrize("equalization, residual_kept", [
    ("union", 4),             # max: channels 0, 1, 3, 6 pass
    ("intersection", 2),      # min: only 3 passes; rounded up to 2 with the next best, 0
    ("arithmetic_mean", 4),   # 0, 1, 3, 6
    ("geometric_mean", 2),    # 0, 3
])
def test_each_equalization_keeps_the_channels_the_rule_says(equalization, residual_kept):
    pruned, report = prune_model(residual_model(), _settings(equalization=equalization))
    # conv_a: 5 pass (0, 2, 4, 5, 7), rounded up to 6 with the best of the rest (6, norm 0.08)
    assert _filters(pruned) == {"conv_a": 6, "conv_b": residual_kept, "conv_s": residual_kept, "head": 2}
    assert pruned.get_layer("conv_b").kernel.shape[2] == 6  # reads conv_a's kept channels
    assert pruned.get_layer("head").kernel.shape[2] == residual_kept
    assert pruned.get_layer("bn_b").gamma.shape[0] == residual_kept == pruned.get_layer("bn_s").gamma.shape[0]
    assert report.params_after < report.params_before and report.flops_after < report.flops_before


def test_kept_indices_by_hand():
    scores_b = filter_scores(residual_model().get_layer("conv_b").get_weights()[0], "max")
    np.testing.assert_allclose(scores_b, NORMS_B, rtol=1e-5)
    union = equalize([np.array(NORMS_B), np.array(NORMS_S)], "union")
    assert kept_channels(union, 0.1, 2, 2).tolist() == [0, 1, 3, 6]
    inter = equalize([np.array(NORMS_B), np.array(NORMS_S)], "intersection")
    assert kept_channels(inter, 0.1, 2, 2).tolist() == [0, 3]
    assert kept_channels(np.array(NORMS_A), 0.1, 2, 2).tolist() == [0, 2, 4, 5, 6, 7]
    assert kept_channels(np.array(NORMS_A), 0.1, 8, 2).tolist() == list(range(8))  # granularity 8: all
    assert kept_channels(np.array(NORMS_A), 0.95, 1, 3).tolist() == [0, 4, 7]  # min_filters floor
    l2 = filter_scores(np.ones((1, 1, 1, 4), np.float32), "L2")
    np.testing.assert_allclose(l2, [0.5] * 4)  # norms / ||norms||


def test_pruned_model_equals_the_masked_original():
    original = residual_model()
    pruned, _ = prune_model(original, _settings())
    kept_a, kept_bs = [0, 2, 4, 5, 6, 7], [0, 1, 3, 6]
    # a removed channel contributes nothing downstream: zero the consumers' weights that read it
    kept = {"conv_b": kept_a, "head": kept_bs}
    masked = masked_copy(original, lambda layer: [c for c in range(8) if layer.name in kept
                                                  and c not in kept[layer.name]])
    x = np.random.default_rng(1).normal(size=(4, 8, 8, 3)).astype(np.float32)
    np.testing.assert_allclose(pruned(x, training=False).numpy(), masked(x, training=False).numpy(),
                               rtol=1e-5, atol=1e-5)


def test_excluded_layers_keep_their_group_whole():
    pruned, report = prune_model(residual_model(), _settings(excluded_layers=["conv_s"]))
    assert _filters(pruned) == {"conv_a": 6, "conv_b": 8, "conv_s": 8, "head": 2}
    whole = {tuple(g["convs"]): g.get("kept_whole") for g in report.groups}
    assert whole[("conv_b", "conv_s")] == "conv_s is excluded"
    assert whole[("head",)].startswith("reaches the model output")
    with pytest.raises(SpecError, match="prune.excluded_layers: no such layers in residual: conv_x"):
        prune_model(residual_model(), _settings(excluded_layers=["conv_x"]))


def test_unsupported_layer_is_named():
    inp = keras.Input((8, 8, 3))
    x = keras.layers.Conv2D(4, 3, name="c")(inp)
    out = keras.layers.Permute((3, 1, 2), name="perm")(x)
    with pytest.raises(ModelFileError, match=r"layer perm \(Permute\) is not supported by pruning"):
        prune_model(keras.Model(inp, out), _settings())


def test_detectnet_residual_blocks_stay_consistent(tiny_spec):
    from qatpipe.models import get_architecture

    spec = tiny_spec("model.backbone.depth=18")
    arch = get_architecture(spec)
    model = arch.build_model()
    for layer in model.layers:  # weaken every other filter of each conv (as strong L1 training would)
        if isinstance(layer, keras.layers.Conv2D) and layer.name not in ("conv_cov", "conv_bbox"):
            kernel = layer.get_weights()[0]
            kernel[..., 1::2] *= 0.05
            layer.set_weights([kernel, *layer.get_weights()[1:]])
    pruned, report = prune_model(model, _settings(threshold=0.3, granularity=8, min_filters=8))
    assert pruned.get_layer("block_3a_conv_1").filters == 32  # half of 64
    for layer in pruned.layers:
        if layer.name.endswith("_conv_2"):
            block = layer.name[: -len("_conv_2")]
            assert layer.filters == pruned.get_layer(f"{block}_conv_shortcut").filters, block
    assert pruned.output_shape == model.output_shape
    assert report.flops_after < 0.4 * report.flops_before  # both sides of most convs halve
    arch.check_model(pruned, "pruned")
    x = np.random.default_rng(0).uniform(size=(1, *model.input_shape[1:])).astype(np.float32)
    assert [o.shape for o in pruned(x)] == [o.shape for o in model(x)]
    heads = [g for g in report.groups if set(g["convs"]) & {"conv_cov", "conv_bbox"}]
    assert heads and all(g["kept_whole"] for g in heads)


def test_prune_command_writes_model_and_report(tmp_path, capsys):
    import json

    from qatpipe.cli import main

    residual_model().save(tmp_path / "model.keras")
    code = main(["prune", "-m", str(tmp_path / "model.keras"), "-o", str(tmp_path / "pruned"), "-pth", "0.1",
                 "-pg", "2", "-nf", "2", "-eq", "intersection", "-el", "conv_a"])
    assert code == 0
    pruned = keras.models.load_model(tmp_path / "pruned" / "model.keras", compile=False)
    assert _filters(pruned) == {"conv_a": 8, "conv_b": 2, "conv_s": 2, "head": 2}
    report = json.loads((tmp_path / "pruned" / "prune_report.json").read_text())
    assert report["settings"]["equalization"] == "intersection" and report["flops_ratio"] < 1
    assert "FLOPs" in capsys.readouterr().out

    # -pth overrides the spec's FLOPs budget; --target-flops-ratio sets one
    from qatpipe.models import get_architecture
    from qatpipe.spec import bundled_spec_path, load_spec

    budget = ["--set", "prune.target_flops_ratio=0.5"]
    get_architecture(load_spec(bundled_spec_path("tiny"))).build_model().save(tmp_path / "detector.keras")
    for flags, expected in ((["-pth", "0.1"], (0.1, None)), ([], (None, 0.5)),
                            (["--target-flops-ratio", "0.7"], (None, 0.7))):
        out = tmp_path / f"pruned_{len(flags)}_{flags[-1] if flags else ''}"
        assert main(["prune", "-m", str(tmp_path / "detector.keras"), "-o", str(out), "-e", "tiny", *budget,
                     *flags]) == 0
        settings = json.loads((out / "prune_report.json").read_text())["settings"]
        assert settings["target_flops_ratio"] == expected[1]
        if expected[0] is not None:
            assert settings["threshold_used"] == expected[0]


def test_prune_command_errors(tmp_path, caplog):
    from qatpipe.cli import main

    assert main(["prune", "-m", str(tmp_path / "missing.keras"), "-o", str(tmp_path / "out")]) == 2
    assert "missing.keras: model file not found" in caplog.text
    (tmp_path / "bad.keras").write_text("not a zip")
    assert main(["prune", "-m", str(tmp_path / "bad.keras"), "-o", str(tmp_path / "out")]) == 2
    assert "bad.keras: corrupt model file" in caplog.text
    assert main(["prune", "-m", str(tmp_path / "bad.keras"), "-o", str(tmp_path / "out"), "-pg", "0"]) == 2
    assert "granularity" in caplog.text


@pytest.mark.slow
def test_retrain_recovers_a_pruned_detector(trained_tiny, tmp_path):
    """train -> prune hard -> retrain: the retrained small model beats the pruned one and keeps its shape."""
    from qatpipe.errors import QatpipeError
    from qatpipe.stages.evaluate import evaluate
    from qatpipe.stages.prune import prune
    from qatpipe.stages.retrain import retrain

    spec, trained = trained_tiny  # the session's briefly trained tiny detector (conftest)
    # a threshold above every score leaves min_filters per group: a heavy, deterministic cut
    result = prune(trained, tmp_path / "pruned", PruneSpec(threshold=1.01, granularity=8, min_filters=16))
    assert result["flops_ratio"] < 0.5
    pruned_map = evaluate(spec, tmp_path / "pruned" / "model.keras", tmp_path / "eval_pruned")["map50"]
    summary = retrain(spec, tmp_path / "pruned" / "model.keras", tmp_path / "retrain")
    assert summary["params"] == result["params_after"]
    retrained = evaluate(spec, tmp_path / "retrain" / "model.keras", tmp_path / "eval_retrained")["map50"]
    assert retrained > pruned_map
    # the checkpoints belong to that pruned model: another one is refused
    keras.models.load_model(trained, compile=False).save(tmp_path / "other.keras")
    with pytest.raises(QatpipeError, match="holds a retraining of another pruned model"):
        retrain(spec, tmp_path / "other.keras", tmp_path / "retrain")


@pytest.mark.parametrize("target", [0.9, 0.6, 0.45])
def test_flops_budget_picks_the_lowest_threshold_within_it(target):
    """prune.target_flops_ratio: the pruned model's FLOPs are within the budget, and the next lower channel score
    as threshold would exceed it (the least pruning that fits); the analytic count equals the rebuilt model's."""
    from qatpipe.pruning.cost import conv_flops

    original = residual_model()
    pruned, report = prune_model(original, _settings(target_flops_ratio=target, granularity=1, min_filters=1))
    assert report.flops_after == conv_flops(pruned)
    assert report.flops_ratio <= target
    used = report.settings["threshold_used"]
    scores = sorted(set(NORMS_A) | {round(float(s), 6) for s in equalize(
        [np.array(NORMS_B), np.array(NORMS_S)], "union")})
    lower = [s for s in scores if s < used - 1e-6]
    if lower:  # one step less pruning breaks the budget
        _, looser = prune_model(original, _settings(threshold=lower[-1], granularity=1, min_filters=1))
        assert looser.flops_ratio > target
    # the same threshold given directly builds the same model
    _, direct = prune_model(original, _settings(threshold=used, granularity=1, min_filters=1))
    assert direct.flops_after == report.flops_after


def test_flops_budget_out_of_reach_prunes_as_far_as_allowed(caplog):
    _, report = prune_model(residual_model(), _settings(target_flops_ratio=0.01, granularity=4, min_filters=4))
    assert report.flops_ratio > 0.01
    assert [g["after"] for g in report.groups if "kept_whole" not in g] == [4, 4]
    assert "out of reach" in caplog.text
