"""train.use_amp picks its policy from the host (GPU, CPU with bfloat16 units, neither) and trains under it.

The host's features are injected (a GPU cannot be had here); the bfloat16 training runs for real on this
CPU (TensorFlow runs bfloat16 on any x86 CPU; with AVX512-BF16 or AMX-BF16 it is also fast)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import tf_keras as keras

from conftest import SMALL_ARCH, SMALL_IMAGES
from qatpipe.stages.train import train
from qatpipe.training import precision
from qatpipe.training.precision import cast_model, cpu_flags, model_policy, select_precision


@pytest.mark.parametrize("use_amp, gpu, flags, policy", [
    (True, True, set(), "mixed_float16"),
    (True, True, {"amx_bf16"}, "mixed_float16"),  # a GPU host trains on the GPU
    (True, False, {"amx_bf16", "amx_int8"}, "mixed_bfloat16"),
    (True, False, {"avx512f", "avx512_bf16"}, "mixed_bfloat16"),
    (True, False, {"avx512f", "avx2"}, "float32"),
    (False, True, {"amx_bf16"}, "float32"),
    (False, False, {"amx_bf16"}, "float32"),
    # auto: only where mixed precision measured faster (bench/README.md)
    ("auto", True, set(), "mixed_float16"),
    ("auto", False, {"avx512_bf16", "amx_bf16"}, "mixed_bfloat16"),
    ("auto", False, {"avx512f", "avx512_bf16"}, "float32"),  # 0.57-0.72x on a Xeon whose AMX is hidden
    ("auto", False, {"avx2", "fma"}, "float32"),
])
def test_policy_follows_the_host(use_amp, gpu, flags, policy):
    chosen = select_precision(use_amp, gpu, frozenset(flags))
    assert chosen.policy == policy and chosen.mixed == (policy != "float32")
    assert chosen.device == ("gpu" if gpu else "cpu")
    if use_amp is True and policy == "float32":
        assert "no bfloat16 CPU instructions" in chosen.reason
    if use_amp == "auto" and policy == "float32":
        assert "use_amp auto: no GPU and no amx_bf16" in chosen.reason


def test_auto_on_a_cpu_where_bfloat16_does_not_pay_trains_fp32_without_a_warning(monkeypatch, caplog):
    _host(monkeypatch, {"avx512f", "avx512_bf16"})
    with caplog.at_level(logging.INFO):
        assert precision.configure_precision("auto").policy == "float32"
    assert "use_amp auto" in caplog.text and not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512_bf16 amx_tile\nbugs\t\t: none\n")
    assert cpu_flags(cpuinfo) == {"fpu", "sse2", "avx512_bf16", "amx_tile"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


def _host(monkeypatch, flags: set[str]):
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr("tensorflow.config.list_physical_devices", lambda kind=None: [])


def test_amp_on_a_cpu_without_bf16_warns_and_trains_fp32(tiny_spec, tmp_path, monkeypatch, caplog):
    _host(monkeypatch, {"avx2"})
    with caplog.at_level(logging.WARNING):
        summary = train(tiny_spec("train.epochs=1", "model.backbone.width=0.125", *SMALL_IMAGES), tmp_path / "run",
                        use_amp=True)
    assert "no bfloat16 CPU instructions" in caplog.text
    assert summary["mixed_precision"] is False and summary["precision"] == "float32"
    assert keras.mixed_precision.global_policy().name == "float32"


@pytest.mark.parametrize("flags, warned", [({"avx512_bf16"}, True), ({"avx512_bf16", "amx_bf16"}, False)])
def test_bf16_without_amx_warns_that_it_may_be_slower(monkeypatch, caplog, flags, warned):
    _host(monkeypatch, flags)
    try:
        with caplog.at_level(logging.WARNING):
            assert precision.configure_precision(True).policy == "mixed_bfloat16"
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert ("this CPU has no AMX" in caplog.text) is warned


@pytest.mark.parametrize("arch", SMALL_ARCH)
def test_bf16_training_step_gives_float32_outputs_and_a_float32_model(tiny_spec, tmp_path, monkeypatch, arch):
    from qatpipe.models import get_architecture
    from qatpipe.models.io import load_keras_model

    _host(monkeypatch, {"avx512_bf16"})
    spec = tiny_spec("train.epochs=1", "model.backbone.width=0.125", *SMALL_ARCH[arch])
    try:
        summary = train(spec, tmp_path / "run", use_amp=True)
        assert keras.mixed_precision.global_policy().name == "mixed_bfloat16"
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert summary["precision"] == "mixed_bfloat16" and summary["mixed_precision"] is True
    losses = summary["final_losses"]
    assert np.isfinite(losses["loss"]) and losses["loss"] > 0
    # the saved model computes in float32 everywhere: later stages (prune, export) never see bfloat16
    model = load_keras_model(tmp_path / "run" / "model.keras", get_architecture(spec))
    assert {layer.dtype_policy.name for layer in model.layers if hasattr(layer, "dtype_policy")} == {"float32"}
    assert all(output.dtype == "float32" for output in model.outputs)


def test_cast_model_keeps_weights_and_float32_outputs(trained_tiny):
    from qatpipe.models import get_architecture
    from qatpipe.models.io import load_keras_model

    spec, model_path = trained_tiny
    model = load_keras_model(model_path, get_architecture(spec))
    twin = cast_model(model, "mixed_bfloat16")
    assert model_policy(model) == "float32" and model_policy(twin) == "mixed_bfloat16"
    assert all(layer.dtype_policy.name == "float32" for layer in twin.layers
               if layer.name in {t.node.layer.name for t in twin.outputs})
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), twin.get_weights()))
    batch = np.random.default_rng(0).random((2, *model.input_shape[1:]), np.float32)
    out32, out16 = model(batch), twin(batch)
    assert all(o.dtype == "float32" for o in out16)
    assert np.allclose(out32[0].numpy(), out16[0].numpy(), atol=0.05)  # bfloat16 keeps ~3 significant digits


def test_train_use_amp_takes_true_false_or_auto_from_the_spec():
    from qatpipe.errors import SpecError
    from qatpipe.spec_sources import load_spec_uri

    assert load_spec_uri("tiny", ["train.use_amp=auto"]).train.use_amp == "auto"
    assert load_spec_uri("tiny", ["train.use_amp=true"]).train.use_amp is True
    with pytest.raises(SpecError, match="train.use_amp"):
        load_spec_uri("tiny", ["train.use_amp=sometimes"])
