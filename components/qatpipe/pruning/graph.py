"""Channel groups of a tf_keras functional model: the layers whose output channels must stay aligned.

A Conv2D (or Dense) starts a channel set (its filters). BatchNormalization, activations and pooling pass
their input's set through, and so does a depthwise convolution: it filters each channel on its own, so its
channels follow its input's (TAO's rule), and its kernel is sliced along with them. An Add or a Multiply
joins the sets of its inputs into one group, because TensorRT, and arithmetic, need both operands to keep
the same channels: that is why TAO equalises residual blocks, and why a squeeze-excitation block's expand
conv is tied to the features it scales. A Reshape or a Concatenate (SSD's heads, flattened to priors and
joined across maps) keeps what it reads whole: its output's layout depends on every channel. The model input's
channels are never pruned, nor are groups that reach a model output or contain an excluded conv.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tf_keras as keras

from qatpipe.errors import ModelFileError
from qatpipe.graph.keras_graph import LayerGraph

# layers that keep their input's channels one-to-one
PASSTHROUGH = (keras.layers.BatchNormalization, keras.layers.Activation, keras.layers.ReLU,
               keras.layers.MaxPooling2D, keras.layers.AveragePooling2D, keras.layers.Dropout,
               keras.layers.GlobalAveragePooling2D, keras.layers.GlobalMaxPooling2D, keras.layers.UpSampling2D)
PRODUCERS = (keras.layers.Conv2D, keras.layers.Dense)  # exact types: their last weight axis is the channels
MERGES = (keras.layers.Add, keras.layers.Multiply)
LAYOUT_CHANGES = (keras.layers.Reshape, keras.layers.Concatenate)  # the channels they read stay whole


@dataclass
class ChannelGroup:
    """One channel set: the convs that produce it, the layers that consume it, and whether it may shrink."""

    producers: list[str] = field(default_factory=list)  # Conv2D layers whose filters make these channels
    prunable: bool = True
    reason: str = ""  # why not prunable


@dataclass
class ChannelGraph:
    groups: list[ChannelGroup]
    group_of_output: dict[str, int]  # layer name -> index of the group its output channels belong to
    group_of_input: dict[str, int]  # conv/dense name -> group of the channels it reads (-1: the model input)


def analyse(model: keras.Model, excluded: set[str]) -> ChannelGraph:
    """Channel groups of `model`; convs in `excluded` (and groups reaching an output) are kept whole."""
    parent: list[int] = []  # union-find over provisional groups

    def new_group() -> int:
        parent.append(len(parent))
        return len(parent) - 1

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    out_group: dict[str, int] = {}
    in_group: dict[str, int] = {}
    producers: dict[int, list[str]] = {}
    frozen: dict[int, str] = {}
    graph = LayerGraph(model)  # refuses a layer used twice
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            out_group[layer.name] = -1
            continue
        sources = [out_group[src.name] for src in graph.producers(layer)]
        if type(layer) in PRODUCERS:
            if getattr(layer, "groups", 1) != 1:
                raise ModelFileError(f"layer {layer.name}: grouped convolutions cannot be pruned")
            in_group[layer.name] = sources[0]
            group = new_group()
            producers[group] = [layer.name]
            if layer.name in excluded:
                frozen[group] = f"{layer.name} is excluded"
            out_group[layer.name] = group
        elif type(layer) is keras.layers.DepthwiseConv2D:
            if layer.depth_multiplier != 1:
                raise ModelFileError(f"layer {layer.name}: a depthwise convolution with depth_multiplier "
                                     f"{layer.depth_multiplier} cannot be pruned (1 only)")
            in_group[layer.name] = out_group[layer.name] = sources[0]
        elif isinstance(layer, PASSTHROUGH):
            out_group[layer.name] = sources[0]
        elif type(layer) in MERGES:
            if -1 in sources:
                raise ModelFileError(f"layer {layer.name} merges the model input; not supported by pruning")
            root = find(sources[0])
            for other in sources[1:]:
                other_root = find(other)
                if other_root != root:
                    parent[other_root] = root
            out_group[layer.name] = root
        elif type(layer) in LAYOUT_CHANGES:
            for source in sources:
                if source >= 0:
                    frozen[source] = frozen.get(source, f"{layer.name} ({type(layer).__name__}) reads them")
            out_group[layer.name] = new_group()
            frozen[out_group[layer.name]] = f"{layer.name} ({type(layer).__name__}) writes them"
        else:
            raise ModelFileError(f"layer {layer.name} ({type(layer).__name__}) is not supported by pruning")
    for output in model.outputs:
        group = out_group[output.node.layer.name]
        if group >= 0:
            frozen[group] = frozen.get(group, f"reaches the model output {output.node.layer.name}")

    # resolve the union-find into final groups
    index: dict[int, int] = {}
    groups: list[ChannelGroup] = []
    for provisional in range(len(parent)):
        root = find(provisional)
        if root not in index:
            index[root] = len(groups)
            groups.append(ChannelGroup())
        group = groups[index[root]]
        group.producers += producers.get(provisional, [])
        if provisional in frozen and group.prunable:
            group.prunable, group.reason = False, frozen[provisional]

    def final(g: int) -> int:
        return -1 if g < 0 else index[find(g)]

    return ChannelGraph(groups, {k: final(v) for k, v in out_group.items()},
                        {k: final(v) for k, v in in_group.items()})
