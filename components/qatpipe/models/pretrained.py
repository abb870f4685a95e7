"""Start a detector from pretrained weights (TAO's pretrained_model_file, freeze_blocks and freeze_bn).

`load_pretrained` copies weights by layer name from a `.keras` or `.h5`/`.hdf5` file (local or s3://), or from
tf_keras.applications' ImageNet models (`keras:imagenet`), into the layers of the same name and weight shapes;
the LoadReport says what loaded, what was skipped (same name, other shapes), what stayed random and what in
the file matched nothing. `freeze` makes the blocks `model.freeze_blocks` names, and with `freeze_bn` every
batch norm, non-trainable. Each backbone's block numbers are its module's `block_of` (docs/pretrained.md).
"""

from __future__ import annotations

import logging
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from qatpipe.errors import ModelFileError, SpecError, StorageError, shown
from qatpipe.models.backbones import backbone_module
from qatpipe.weights import PREFIX as PACKAGED_PREFIX
from qatpipe.weights import lookup as lookup_packaged

log = logging.getLogger(__name__)

KEY = "model.pretrained"
IMAGENET = "keras:imagenet"
SUFFIXES = (".keras", ".h5", ".hdf5")

# layer name -> its weights, in the layer's own order (layer.get_weights())
Weights = dict[str, list[np.ndarray]]


@dataclass
class LoadReport:
    """What load_pretrained did, layer by layer (JSON-writable with to_dict)."""

    source: str
    loaded: list[str] = field(default_factory=list)
    # same name, other weight shapes: {"layer", "model_shapes", "file_shapes"}
    skipped: list[dict] = field(default_factory=list)
    random: list[str] = field(default_factory=list)  # layers with weights that the file has no layer for
    random_backbone: list[str] = field(default_factory=list)  # those of `random` in the backbone
    unused: list[str] = field(default_factory=list)  # layers of the file that match no layer of the model

    def summary(self) -> str:
        skipped = f" ({', '.join(s['layer'] for s in self.skipped)})" if self.skipped else ""
        return (f"pretrained weights from {shown(self.source)}: {len(self.loaded)} layers loaded, "
                f"{len(self.skipped)} skipped for other shapes{skipped}, {len(self.random)} left random "
                f"({len(self.random_backbone)} in the backbone), {len(self.unused)} of the file's unused")

    def to_dict(self) -> dict:
        return {**asdict(self), "summary": self.summary()}


# -------------------------------------------------------------------------------------------- sources


def resolve_pretrained(source: str, backbone_spec, cache_dir: str | Path = ".qatpipe-cache") -> str:
    """`source` checked and made local: a local file path (an s3:// object downloaded into `cache_dir`), or
    `keras:imagenet` once the backbone and width are known to have ImageNet weights. Errors name the key, the
    file and the reason, so a training fails here, before its first epoch."""
    from qatpipe.spec import PIPELINE_PRETRAINED

    if source == PIPELINE_PRETRAINED:  # the pipeline's train component puts its pretrain stage's file here
        raise SpecError(f"{KEY}: {PIPELINE_PRETRAINED} names a pipeline run's own pretrain stage; outside a "
                        "pipeline run, give the path of qatpipe pretrain's weights.keras")
    if source.startswith(PACKAGED_PREFIX):  # a start shipped with the package: its card's backbone and SHA-256
        return str(lookup_packaged(source, backbone_spec).verified_path())
    if source.startswith("keras:"):
        if source != IMAGENET:
            raise SpecError(f"{KEY}: {shown(source)} is not a source; the only keras: one is {IMAGENET}")
        _keras_application(backbone_spec)
        return source
    if source.startswith("s3://"):
        from qatpipe.storage import download_s3_file

        try:
            path = download_s3_file(source, cache_dir)
        except StorageError as exc:
            raise StorageError(f"{KEY}: {exc}") from None
    else:
        path = Path(source)
    _check_file(path)
    return str(path)


def _check_file(path: Path) -> None:
    import h5py

    if not path.is_file():
        raise ModelFileError(f"{KEY}: {shown(path)}: " + ("a folder, not a weights file" if path.is_dir() else
                                                           "pretrained weights file not found"))
    if path.suffix.lower() not in SUFFIXES:
        raise ModelFileError(f"{KEY}: {shown(path)}: not a Keras weights file (expected {', '.join(SUFFIXES)}, an "
                             f"s3:// URI of one, or {IMAGENET})")
    if not (zipfile.is_zipfile(path) or h5py.is_hdf5(path)):
        raise ModelFileError(f"{KEY}: {shown(path)}: corrupt weights file (neither a .keras zip archive nor HDF5)")


def read_weights(path: str | Path) -> Weights:
    """The weights of every layer in a `.keras` model file or a `.h5` model or weights file, by layer name
    (the layers of nested models too)."""
    path = Path(path)
    _check_file(path)
    try:
        if zipfile.is_zipfile(path):
            return model_weights(_load_model(path))
        return _h5_weights(path)
    except ModelFileError:
        raise
    except Exception as exc:  # Keras and h5py raise many kinds (ValueError, OSError, KeyError) for bad files
        raise ModelFileError(f"{KEY}: {shown(path)}: cannot read its weights: {type(exc).__name__}: {exc}") from None


def _load_model(path: Path):
    import tf_keras as keras

    # a QAT model's file loads where its layers are registered (models/io.py; the train stage registers them)
    return keras.models.load_model(path, compile=False)


def _flat_layers(model) -> list:
    layers = []
    for layer in model.layers:
        layers += _flat_layers(layer) if hasattr(layer, "layers") else [layer]
    return layers


def model_weights(model) -> Weights:
    weights: Weights = {}
    for layer in _flat_layers(model):
        if layer.weights:
            weights.setdefault(layer.name, layer.get_weights())
    return weights


def _h5_names(group, attribute: str) -> list[str]:
    # Keras splits a long attribute into `name0`, `name1`, ... (HDF5's 64 kB header limit)
    if attribute in group.attrs:
        values = list(group.attrs[attribute])
    else:
        values, chunk = [], 0
        while f"{attribute}{chunk}" in group.attrs:
            values += list(group.attrs[f"{attribute}{chunk}"])
            chunk += 1
    return [value.decode() if isinstance(value, bytes) else str(value) for value in values]


def _h5_weights(path: Path) -> Weights:
    """A Keras HDF5 file's weights, read as saved (model.save or save_weights, tf_keras or TAO's Keras) without
    building its model."""
    import h5py

    with h5py.File(path, "r") as handle:
        root = handle["model_weights"] if "model_weights" in handle else handle
        layer_names = _h5_names(root, "layer_names")
        if not layer_names:
            raise ModelFileError(f"{KEY}: {shown(path)}: an HDF5 file without Keras layer weights")
        weights: Weights = {}
        for layer_name in layer_names:
            group = root[layer_name]
            names = _h5_names(group, "weight_names")
            # a nested model's group holds its layers' weights, each named `<layer>/<weight>:0`
            owners = [name.split("/")[-2] if "/" in name else layer_name for name in names]
            nested = len(set(owners)) > 1
            for name, owner in zip(names, owners):
                weights.setdefault(owner if nested else layer_name, []).append(np.asarray(group[name]))
        return weights


# ----------------------------------------------------------------------------------- keras:imagenet


def _keras_application(backbone_spec):
    """The backbone's KerasApplication, once it has ImageNet weights at the spec's width."""
    application = getattr(backbone_module(backbone_spec.name), "KERAS_APPLICATION", None)
    if application is None:
        raise SpecError(
            f"{KEY}: {IMAGENET} has no weights for the {backbone_spec.name} backbone (tf_keras.applications' "
            "ResNets are ResNet-50 and deeper, with other layer names); TAO's ResNet-10/18/34 weights load as "
            "files: set model.pretrained to the .hdf5 path (docs/pretrained.md)")
    if float(backbone_spec.width) not in application.widths:
        raise SpecError(
            f"{KEY}: {IMAGENET} has {backbone_spec.name} weights for widths (alpha) "
            f"{', '.join(f'{w:g}' for w in application.widths)}; model.backbone.width is {backbone_spec.width:g}")
    return application


def imagenet_weights(backbone_spec) -> Weights:
    """tf_keras.applications' ImageNet weights of the backbone, under its layer names. Keras downloads the
    file once into ~/.keras/models (/tmp/.keras/models when the home folder is not writable); offline, a file
    put there loads."""
    application = _keras_application(backbone_spec)
    try:
        model = application.build(float(backbone_spec.width), "imagenet")
    except Exception as exc:  # noqa: BLE001 - a download failure is an Exception("URL fetch failure ...")
        raise ModelFileError(
            f"{KEY}: {IMAGENET}: cannot get {backbone_spec.name}'s ImageNet weights ({type(exc).__name__}: "
            f"{exc}); offline, put tf_keras.applications' weights file into ~/.keras/models "
            "(docs/pretrained.md names it)") from None
    return applications_weights(model, backbone_spec)


def applications_weights(model, backbone_spec) -> Weights:
    """A tf_keras.applications model's weights under the backbone's layer names, converted to compute what the
    applications model computes: batch norm variances to qatpipe's epsilon, and the model's input scaling
    (an image in [0, 1] -> what it reads) folded into the first conv and its batch norm (exact but for the
    image border, where the conv's zero padding now pads the [0, 1] image)."""
    import tf_keras as keras

    from qatpipe.models.blocks import BN_EPSILON

    application = _keras_application(backbone_spec)
    weights: Weights = {}
    for layer in _flat_layers(model):
        arrays = layer.get_weights()
        if not arrays:
            continue
        if isinstance(layer, keras.layers.BatchNormalization) and layer.scale and layer.center:
            gamma, beta, mean, variance = arrays  # same variance + epsilon, so the same normalisation
            arrays = [gamma, beta, mean, variance + np.float32(layer.epsilon - BN_EPSILON)]
        weights[application.rename(layer.name)] = arrays

    conv_name, bn_name = application.stem
    source_conv = next(layer for layer in _flat_layers(model) if application.rename(layer.name) == conv_name)
    offset, scale = _input_affine(model, source_conv, application)
    kernel, *bias = weights[conv_name]
    weights[conv_name] = [kernel * scale[None, None, :, None], *bias]
    # the conv of the unscaled image misses sum(kernel * offset) per output channel: the batch norm's mean too
    gamma, beta, mean, variance = weights[bn_name]
    missing = np.einsum("hwio,i->o", kernel, offset).astype(np.float32)
    weights[bn_name] = [gamma, beta, mean - missing, variance]
    return weights


def _input_affine(model, stem_conv, application) -> tuple[np.ndarray, np.ndarray]:
    """Per input channel, offset and scale of what the stem conv reads for an image in [0, 1] (one pixel of
    a black and a white image: the model's preprocessing is per channel)."""
    import tf_keras as keras

    probe = keras.Model(model.inputs, stem_conv.input)
    height, width, channels = model.input_shape[1:]
    images = np.stack([np.zeros((height, width, channels), np.float32), np.ones((height, width, channels),
                                                                                np.float32)])
    seen = np.asarray(probe(application.preprocess(images), training=False))[:, height // 4, width // 4, :]
    return seen[0], seen[1] - seen[0]


# ------------------------------------------------------------------------------------------ loading


def load_weights(model, weights: Weights, source: str, backbone_spec) -> LoadReport:
    """Copy `weights` into the layers of `model` with the same name and weight shapes; a ModelFileError when
    none of the backbone's layers took any."""
    block_of = backbone_module(backbone_spec.name).block_of
    report = LoadReport(source=str(source))
    targets = [layer for layer in _flat_layers(model) if layer.weights]
    for layer in targets:
        arrays = weights.get(layer.name)
        if arrays is None:
            report.random.append(layer.name)
            if block_of(layer.name) is not None:
                report.random_backbone.append(layer.name)
            continue
        model_shapes = [list(w.shape) for w in layer.weights]
        file_shapes = [list(a.shape) for a in arrays]
        if model_shapes != file_shapes:
            report.skipped.append({"layer": layer.name, "model_shapes": model_shapes, "file_shapes": file_shapes})
            continue
        layer.set_weights(arrays)
        report.loaded.append(layer.name)
    names = {layer.name for layer in targets}
    report.unused = [name for name in weights if name not in names]

    backbone = [layer.name for layer in targets if block_of(layer.name) is not None]
    if not any(block_of(name) is not None for name in report.loaded):
        skipped = [s for s in report.skipped if block_of(s["layer"]) is not None]
        if skipped:
            first = skipped[0]
            raise ModelFileError(
                f"{KEY}: {shown(source)}: the backbone's layers have other weight shapes there, e.g. "
                f"{first['layer']}: {first['file_shapes']} in the file, {first['model_shapes']} in the model "
                "(another model.backbone.width or depth?)")
        raise ModelFileError(f"{KEY}: nothing in {shown(source)} matches the backbone's layers (the file has "
                             f"{_few(list(weights))}; the {backbone_spec.name} backbone has {_few(backbone)})")
    log.info("%s", report.summary())
    if report.skipped or report.random_backbone:
        log.warning("pretrained weights: skipped for other shapes: %s; backbone layers left random: %s",
                    ", ".join(s["layer"] for s in report.skipped) or "none",
                    ", ".join(report.random_backbone) or "none")
    return report


def _few(names: list[str], count: int = 4) -> str:
    return ", ".join(names[:count]) + (f", ... ({len(names)} layers)" if len(names) > count else "")


def load_pretrained(model, source: str, backbone_spec, cache_dir: str | Path = ".qatpipe-cache",
                    resolved: str | None = None) -> LoadReport:
    """Load `source` (model.pretrained: a path, s3:// URI or keras:imagenet) into `model`'s layers by name;
    `resolved` is resolve_pretrained's answer where the caller has it already."""
    local = resolved or resolve_pretrained(source, backbone_spec, cache_dir)
    weights = imagenet_weights(backbone_spec) if local == IMAGENET else read_weights(local)
    return load_weights(model, weights, source, backbone_spec)


def load_applications_file(model, path: str | Path, backbone_spec) -> LoadReport:
    """`keras:imagenet`'s mapping on a saved tf_keras.applications model (a .keras or full-model .h5 file):
    the same weights without the network."""
    path = Path(path)
    _check_file(path)
    try:
        application_model = _load_model(path)
    except Exception as exc:  # noqa: BLE001 - Keras raises many kinds for bad files
        raise ModelFileError(f"{KEY}: {shown(path)}: cannot load the model: {type(exc).__name__}: {exc}") from None
    return load_weights(model, applications_weights(application_model, backbone_spec), str(path), backbone_spec)


# ------------------------------------------------------------------------------------------- freezing


def check_freeze_blocks(backbone_spec, freeze_blocks) -> None:
    """A SpecError naming model.freeze_blocks when it names a block the backbone does not have."""
    valid = backbone_module(backbone_spec.name).FREEZE_BLOCKS
    unknown = sorted(set(freeze_blocks) - set(valid))
    if unknown:
        raise SpecError(f"model.freeze_blocks: {', '.join(map(str, unknown))} not a block of the "
                        f"{backbone_spec.name} backbone; its blocks are {valid[0]}-{valid[-1]} (docs/pretrained.md)")


def freeze(model, backbone_spec, freeze_blocks, freeze_bn: bool) -> list[str]:
    """Make non-trainable every layer (batch norm included) of the blocks `freeze_blocks` names, and with
    `freeze_bn` every BatchNormalization layer; returns their names. Layers are found by name, so a pruned or
    QAT model (same names) freezes the same layers. In tf_keras a non-trainable BatchNormalization also runs
    in inference mode: its moving statistics stay as loaded."""
    import tf_keras as keras

    check_freeze_blocks(backbone_spec, freeze_blocks)
    block_of = backbone_module(backbone_spec.name).block_of
    blocks = set(freeze_blocks)
    frozen = []
    for layer in _flat_layers(model):
        if not layer.weights:
            continue
        if block_of(layer.name) in blocks or (freeze_bn and isinstance(layer, keras.layers.BatchNormalization)):
            layer.trainable = False
            frozen.append(layer.name)
    if frozen:
        log.info("frozen: %d layers (model.freeze_blocks %s%s)", len(frozen), sorted(blocks),
                 ", every batch norm" if freeze_bn else "")
    return frozen


__all__ = ["IMAGENET", "LoadReport", "applications_weights", "check_freeze_blocks", "freeze",
           "imagenet_weights", "load_applications_file", "load_pretrained", "load_weights", "read_weights",
           "resolve_pretrained"]
