"""Training precision: which Keras mixed-precision policy `train.use_amp` means on the host at hand.

- A GPU: `mixed_float16` (Keras adds loss scaling), as on NVIDIA's tensor cores.
- A CPU with bfloat16 instructions (Intel AMX-BF16, AVX512-BF16 on Intel and AMD): `mixed_bfloat16`, which
  TensorFlow's oneDNN kernels run on those units. bfloat16 keeps float32's exponent range: no loss scaling.
- Anything else: float32, with a warning.
`auto` takes mixed precision only where it measured faster (bench/README.md, amp.py and train_speed.py): a GPU,
or a CPU with AMX-BF16; elsewhere float32, without a warning (AVX512-BF16 alone was 1.49x on an AMD EPYC but
0.57-0.72x on an Intel Xeon whose AMX is hidden).

Variables stay float32 under every policy; the detector's output layers are float32 by construction, so the
losses are computed in float32; QAT's fake quantization always computes in float32 (quantization/transform.py).
The model a stage saves is cast back to a plain float32 model (`cast_model`), so later stages (prune,
export, evaluate) never inherit the training policy.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from qatpipe.devices import cpu_flags

log = logging.getLogger(__name__)

FLOAT32, MIXED_FLOAT16, MIXED_BFLOAT16 = "float32", "mixed_float16", "mixed_bfloat16"
AUTO = "auto"  # train.use_amp: mixed precision where it measured faster, else float32
# /proc/cpuinfo flags of CPUs whose oneDNN kernels compute bfloat16 matrix products natively
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@dataclass(frozen=True)
class Precision:
    policy: str  # the Keras mixed-precision policy name
    device: str  # "gpu" or "cpu"
    reason: str  # why this policy, for the log and the training summary

    @property
    def mixed(self) -> bool:
        return self.policy != FLOAT32


def select_precision(use_amp: bool | str, has_gpu: bool, flags: frozenset[str]) -> Precision:
    """The policy for `use_amp` (true, false or AUTO) on a host with (or without) a GPU and these CPU flags."""
    device = "gpu" if has_gpu else "cpu"
    if not use_amp:
        return Precision(FLOAT32, device, "mixed precision off (train.use_amp: false)")
    if has_gpu:
        return Precision(MIXED_FLOAT16, device, "GPU: float16 compute, float32 variables, loss scaling")
    if use_amp == AUTO:
        if "amx_bf16" in flags:
            return Precision(MIXED_BFLOAT16, device, "use_amp auto, a CPU with amx_bf16: bfloat16 compute on its "
                                                     "AMX tiles, float32 variables")
        return Precision(FLOAT32, device, "use_amp auto: no GPU and no amx_bf16, where bfloat16 is not reliably "
                                          "faster; float32")
    bf16 = [flag for flag in BF16_CPU_FLAGS if flag in flags]
    if bf16:
        return Precision(MIXED_BFLOAT16, device, f"CPU with {' and '.join(bf16)}: bfloat16 compute, float32 "
                                                 "variables")
    return Precision(FLOAT32, device, "no GPU and no bfloat16 CPU instructions "
                                      f"({', '.join(BF16_CPU_FLAGS)}): mixed precision would be slower; float32")


def configure_precision(use_amp: bool | str) -> Precision:
    """Detect the host, set Keras' global policy accordingly and log the choice."""
    import tensorflow as tf
    import tf_keras as keras

    flags = cpu_flags()
    precision = select_precision(use_amp, bool(tf.config.list_physical_devices("GPU")), flags)
    keras.mixed_precision.set_global_policy(precision.policy)
    if use_amp is True and not precision.mixed:
        log.warning("--use-amp: %s", precision.reason)
    else:
        log.info("precision: %s (%s)", precision.policy, precision.reason)
    if precision.policy == MIXED_BFLOAT16 and "amx_bf16" not in flags:
        log.warning("--use-amp: this CPU has no AMX, and without it bfloat16 training is not always faster than "
                    "float32 (docs/scale-out.md); time it here with bench/amp.py before relying on AMP")
    return precision


def cast_model(model, policy: str):
    """A copy of a functional tf_keras `model` whose layers compute under `policy`, with the same weights.

    The layers that produce the model's outputs stay float32 (losses and decoders read float32). Used to
    train a loaded model (a pruned one) under mixed precision, and to save a trained model as plain float32.
    """
    import tf_keras as keras

    output_layers = {tensor.node.layer.name for tensor in model.outputs}
    config = model.get_config()
    for layer in config["layers"]:
        if layer["class_name"] == "InputLayer":
            continue
        layer["config"]["dtype"] = FLOAT32 if layer["name"] in output_layers else policy
    # custom objects already registered (QAT layers) resolve through Keras' global registry
    twin = keras.Model.from_config(config)
    twin.set_weights(model.get_weights())
    return twin


def model_policy(model) -> str:
    """The policy most of `model`'s layers compute under (float32 for a saved qatpipe model)."""
    names = [layer.dtype_policy.name for layer in model.layers if hasattr(layer, "dtype_policy")]
    return max(set(names), key=names.count) if names else FLOAT32


__all__ = ["Precision", "select_precision", "configure_precision", "cast_model", "model_policy", "cpu_flags",
           "FLOAT32", "MIXED_FLOAT16", "MIXED_BFLOAT16", "BF16_CPU_FLAGS"]
