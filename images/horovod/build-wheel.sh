#!/usr/bin/env bash
# Builds a Horovod wheel against the TensorFlow installed in $PYTHON's environment, once per TensorFlow version.
#
#   PYTHON=.venv/bin/python images/horovod/build-wheel.sh [WHEEL_DIR]    # default WHEEL_DIR: .cache/wheels
#
# Prints the wheel's path on stdout. Horovod 0.28.1 (its last release) does not build against TensorFlow 2.21
# as released; three changes make it build:
#   - horovod/tensorflow/CMakeLists.txt lists xla_mpi_ops.cc, written against XLA headers TF 2.21 no longer
#     ships: the line is deleted (Horovod's XLA ops are opt-in, HOROVOD_ENABLE_XLA_OPS; nothing here uses them);
#   - TF 2.21's headers include highwayhash and farmhash headers from folders TF's include path does not list:
#     they go on CXXFLAGS;
#   - its sources use std::string, std::logic_error and the fixed-width integers without including <string>,
#     <stdexcept>, <cstdint>, which GCC 13 (Ubuntu 24.04's) no longer pulls in through other headers: they go on
#     CXXFLAGS as -include.
# The sdist is read with the environment's own setuptools (--no-build-isolation): an offline image build has no
# index to fetch a build environment from.
# The wheel lands in WHEEL_DIR/tf-<version>/ because pip's own cache does not key builds by TF version
# (hence --no-cache-dir): re-installs reuse it and take seconds instead of ~8 minutes on 2 cores.
# Frameworks and transports come from the usual HOROVOD_* variables; unset, this builds TensorFlow + Gloo (what
# the CPU tests use). The training image sets HOROVOD_WITH_MPI=1 and HOROVOD_GPU_OPERATIONS=NCCL.
set -euo pipefail

PYTHON="${PYTHON:-python3}"
HOROVOD_VERSION="${HOROVOD_VERSION:-0.28.1}"
WHEEL_DIR="${1:-.cache/wheels}"

tf_version="$("$PYTHON" -c 'import tensorflow as tf; print(tf.__version__)' 2>/dev/null)"
out_dir="$WHEEL_DIR/tf-$tf_version"
shopt -s nullglob
existing=("$out_dir"/horovod-"$HOROVOD_VERSION"-*.whl)
if (( ${#existing[@]} )); then
    echo "horovod $HOROVOD_VERSION for TensorFlow $tf_version: reusing ${existing[0]}" >&2
    echo "${existing[0]}"
    exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "horovod $HOROVOD_VERSION for TensorFlow $tf_version: building (3-8 minutes on 2 cores)" >&2
"$PYTHON" -m pip download --quiet --no-deps --no-binary :all: --no-cache-dir --no-build-isolation \
    "horovod==$HOROVOD_VERSION" -d "$work" >&2
tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
source_dir="$work/horovod-$HOROVOD_VERSION"
cmake_lists="$source_dir/horovod/tensorflow/CMakeLists.txt"
grep -q 'xla_mpi_ops.cc' "$cmake_lists" || { echo "xla_mpi_ops.cc not in $cmake_lists: fix no longer applies" >&2; exit 1; }
sed -i '/xla_mpi_ops\.cc/d' "$cmake_lists"

tf_include="$("$PYTHON" -c 'import tensorflow as tf; print(tf.sysconfig.get_include())' 2>/dev/null)"
export CXXFLAGS="${CXXFLAGS:-} -I$tf_include/external/highwayhash -I$tf_include/external/farmhash_archive/src"
# GCC 13 (Ubuntu 24.04's, the images' compiler) no longer pulls these in through other standard headers, and
# Horovod's sources use them without including them
CXXFLAGS="$CXXFLAGS -include cstdint -include stdexcept -include string"
export HOROVOD_WITH_TENSORFLOW="${HOROVOD_WITH_TENSORFLOW:-1}"
export HOROVOD_WITHOUT_PYTORCH="${HOROVOD_WITHOUT_PYTORCH:-1}"
export HOROVOD_WITHOUT_MXNET="${HOROVOD_WITHOUT_MXNET:-1}"
export HOROVOD_WITH_GLOO="${HOROVOD_WITH_GLOO:-1}"
MAKEFLAGS="-j$(nproc)"
export MAKEFLAGS

mkdir -p "$out_dir"
"$PYTHON" -m pip wheel --no-deps --no-build-isolation --no-cache-dir -w "$work/wheel" "$source_dir" >&2
wheel=("$work"/wheel/horovod-"$HOROVOD_VERSION"-*.whl)
mv "${wheel[0]}" "$out_dir/"
echo "$out_dir/$(basename "${wheel[0]}")"
