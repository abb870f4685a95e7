#!/usr/bin/env bash
# Builds the three qatpipe images (training, engine, mlflow), and pushes them with --push, under the names the
# pipeline uses: `python -m qatpipe_kfp.settings` prints them, after --repository / --tag are exported as
# QATPIPE_IMAGE_REPOSITORY / QATPIPE_IMAGE_TAG, the variables the pipeline's compile reads too.
#
#   images/build.sh --tag 0.1.0 --repository ghcr.io/you --push
#   images/build.sh --cpu          # the CPU variant, offline: local bases and a wheelhouse (`make images`)
#
# Context: the repository root (.dockerignore keeps it to the sources); Dockerfile: images/<kind>/Dockerfile.
# Environment: PYTHON, an interpreter with qatpipe installed (default: .venv/bin/python, else python3);
# DOCKER, the client (default: docker, else podman). BuildKit (or podman) is required: the Dockerfiles use
# RUN --mount.
set -euo pipefail

readonly KINDS=(training engine mlflow)

usage() {
    cat <<'EOF'
Usage: images/build.sh [OPTIONS]

Builds the qatpipe images under the names `python -m qatpipe_kfp.settings` gives.

Options:
  --tag TAG            image tag (default: $QATPIPE_IMAGE_TAG, else the project version)
  --repository REPO    registry and namespace, e.g. ghcr.io/you
                       (default: $QATPIPE_IMAGE_REPOSITORY, else ghcr.io/qatpipe)
  --only KIND          build only KIND: training, engine or mlflow (repeatable)
  --platform PLATFORM  target platform for docker build, e.g. linux/amd64
  --cpu                the CPU variant, built without network: bases from images/local-base.sh
                       (debootstrap, needs root), packages from the wheelhouse of images/wheelhouse.py
  --push               push the images once all are built
  --dry-run            print the docker commands instead of running them
  -h, --help           show this help
EOF
}

fail() {  # usage errors: exit 2, like getopt
    echo "images/build.sh: $*" >&2
    echo "Try 'images/build.sh --help'." >&2
    exit 2
}

only=()
platform=""
push=0
dry_run=0
cpu=0
while (($#)); do
    option="$1"
    value=""
    case "$option" in
        --tag=* | --repository=* | --only=* | --platform=*)
            value="${option#*=}"
            option="${option%%=*}"
            shift
            ;;
        --tag | --repository | --only | --platform)
            (($# >= 2)) || fail "$option needs a value"
            value="$2"
            shift 2
            ;;
        *) shift ;;
    esac
    case "$option" in
        --tag)
            [[ "$value" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || fail "not a valid image tag: '$value'"
            export QATPIPE_IMAGE_TAG="$value"
            ;;
        --repository)
            # registry[:port]/namespace, lower case as image names must be
            [[ "$value" =~ ^[a-z0-9]([a-z0-9._:/-]*[a-z0-9])?$ ]] || fail "not a valid image repository: '$value'"
            export QATPIPE_IMAGE_REPOSITORY="$value"
            ;;
        --only)
            case "$value" in
                training | engine | mlflow) only+=("$value") ;;
                *) fail "--only takes training, engine or mlflow, not '$value'" ;;
            esac
            ;;
        --platform) platform="$value" ;;
        --push) push=1 ;;
        --cpu) cpu=1 ;;
        --dry-run) dry_run=1 ;;
        -h | --help)
            usage
            exit 0
            ;;
        *) fail "unknown option: $option" ;;
    esac
done

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

python="${PYTHON:-}"
if [[ -z "$python" ]]; then
    if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
docker="${DOCKER:-}"
if [[ -z "$docker" ]]; then  # a dry run prints docker's commands; podman takes the same
    if ((dry_run)); then docker=docker
    elif command -v docker >/dev/null && docker info >/dev/null 2>&1; then docker=docker
    elif command -v podman >/dev/null; then docker=podman
    else docker=docker; fi
fi

# "kind name" lines from the settings' JSON: the one place that names the images
listing="$("$python" -m qatpipe_kfp.settings)" \
    || fail "$python -m qatpipe_kfp.settings failed (PYTHON: an interpreter with qatpipe installed)"
names="$("$python" -c 'import json, sys
for kind, name in json.loads(sys.argv[1]).items():
    print(kind, name)' "$listing")"

image_of() {  # image_of KIND -> the image name the settings give for KIND
    local kind name
    while read -r kind name; do
        if [[ "$kind" == "$1" ]]; then
            echo "$name"
            return 0
        fi
    done <<<"$names"
    echo "images/build.sh: python -m qatpipe_kfp.settings names no '$1' image" >&2
    return 1
}

selected=()
for kind in "${KINDS[@]}"; do
    if ((${#only[@]} == 0)) || [[ " ${only[*]} " == *" $kind "* ]]; then
        selected+=("$kind")
    fi
done

run() {  # the command, or with --dry-run its shell-quoted text
    if ((dry_run)); then
        printf '%q' "$1"
        shift
        (($# == 0)) || printf ' %q' "$@"
        printf '\n'
    else
        "$@"
    fi
}

if ((!dry_run)); then
    command -v "$docker" >/dev/null \
        || fail "no container engine: install podman (apt-get install podman runc) or Docker, or set DOCKER"
    export DOCKER_BUILDKIT=1  # RUN --mount in the Dockerfiles; BuildKit is the default from Docker 23 on
fi

# the commit the images are built from: their revision label, and MLflow's mlflow.source.git.commit tag
git_commit="$(git rev-parse HEAD 2>/dev/null || true)"
# the source label: the git remote, without user or token (https://user:token@host/... keeps only host/...)
source_url="$(git remote get-url origin 2>/dev/null || true)"
source_url="$(printf '%s' "$source_url" | sed -E 's#^([a-z+]+://)[^/@]*@#\1#')"

# --cpu: the local bases and the wheelhouse, each made once and cached under $QATPIPE_CACHE (default .cache/;
# a folder outside the clone lets fresh clones on one machine share them, as they share podman's image store);
# the builds' logs go there too
cache="${QATPIPE_CACHE:-$root/.cache}"
cpu_args=()
declare -A base_of=()
if ((cpu)); then
    wheelhouse="$cache/wheelhouse"
    if ((dry_run)); then
        base_of=([runtime]=BASE_RUNTIME [devel]=BASE_DEVEL [mlflow]=BASE_MLFLOW)
    else
        # both at once: the wheelhouse waits on PyPI, the bases mostly on the distributions' archives
        "$python" images/wheelhouse.py --cpu --dest "$wheelhouse" "${selected[@]}" &
        wheelhouse_pid=$!
        if ! bases="$(DOCKER="$docker" images/local-base.sh "$cache/images")"; then
            wait "$wheelhouse_pid" || true
            fail "images/local-base.sh failed (above)"
        fi
        wait "$wheelhouse_pid" || fail "the wheelhouse is incomplete (above); images/wheelhouse.py --cpu makes it"
        while read -r kind base; do base_of[$kind]="$base"; done <<<"$bases"
        [[ -n "${base_of[runtime]:-}" ]] || fail "images/local-base.sh made no base (above)"
    fi
    # --network none: the offline build shown to be one (its packages from the wheelhouse, its bases preinstalled)
    cpu_args=(--build-arg VARIANT=cpu --build-arg PIP_NO_INDEX=1 --build-context "wheelhouse=$wheelhouse"
              --network none)
fi

# Cache keys (the Dockerfiles' QATPIPE_*LOCK_SHA256, QATPIPE_SOURCE_SHA256): podman does not hash what a
# RUN --mount binds, so without them it would reuse a layer installed from an older lock or older sources
hash_files() { find "$@" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z | xargs -0 sha256sum \
    | sha256sum | cut -c1-64; }
source_sha="$(hash_files pyproject.toml README.md components pipelines)"

images=()
pids=()
logs="$cache/logs"
if ((!dry_run)); then mkdir -p "$logs"; fi
for kind in "${selected[@]}"; do
    image="$(image_of "$kind")"
    images+=("$image")
    command=("$docker" build -f "images/$kind/Dockerfile" -t "$image" --build-arg "QATPIPE_VERSION=${image##*:}"
             --build-arg "QATPIPE_GIT_COMMIT=$git_commit" --build-arg "QATPIPE_SOURCE_SHA256=$source_sha")
    if [[ "$kind" == training ]]; then  # a key per layer group: TensorFlow and Horovod, the rest, Model Optimizer
        command+=(--build-arg "QATPIPE_BASE_LOCK_SHA256=$(hash_files images/training/requirements-base.lock)"
                  --build-arg "QATPIPE_LOCK_SHA256=$(hash_files images/training/requirements.lock)"
                  --build-arg "QATPIPE_MODELOPT_LOCK_SHA256=$(hash_files images/modelopt/*.lock)")
    else
        command+=(--build-arg "QATPIPE_LOCK_SHA256=$(hash_files "images/$kind"/*.lock)")
    fi
    if [[ -n "$source_url" ]]; then command+=(--build-arg "QATPIPE_SOURCE=$source_url"); fi
    if ((cpu)); then
        command+=("${cpu_args[@]}")
        case "$kind" in
            training) command+=(--build-arg "BUILDER_IMAGE=${base_of[devel]}" --build-arg "BASE_IMAGE=${base_of[runtime]}") ;;
            engine) command+=(--build-arg "BASE_IMAGE=${base_of[runtime]}") ;;
            mlflow) command+=(--build-arg "BASE_IMAGE=${base_of[mlflow]}") ;;
        esac
    fi
    if [[ -n "$platform" ]]; then command+=(--platform "$platform"); fi
    if ((dry_run)); then
        run "${command[@]}" .
        continue
    fi
    # the builds run side by side (pip's installs are single-threaded: two keep both cores busy), each into its log
    log="$logs/build-$kind.log"
    echo "images/build.sh: building $image (log: $log)" >&2
    (
        start=$SECONDS
        "${command[@]}" . >"$log" 2>&1
        echo "images/build.sh: $kind built in $((SECONDS - start)) s" >&2
    ) &
    pids+=($!)
done

if ((!dry_run)); then  # wait for the builds, saying every minute where each one is; a failed one shows its log
    start=$SECONDS
    while (($(jobs -rp | wc -l))); do
        sleep 5
        if (((SECONDS - start) % 60 < 5)); then
            for i in "${!pids[@]}"; do
                kill -0 "${pids[i]}" 2>/dev/null || continue  # done
                kind="${selected[i]}"
                # podman's `[2/3] STEP 8/19`, BuildKit's `#18 [builder 6/8]`
                step="$(grep -oE '^(\[[0-9]+/[0-9]+\] STEP [0-9]+/[0-9]+|#[0-9]+ \[[^]]+\])' "$logs/build-$kind.log" \
                    2>/dev/null | tail -n 1 | sed -E 's/^#[0-9]+ //' || true)"
                if [[ -n "$step" ]]; then echo "images/build.sh: $((SECONDS - start)) s: $kind at $step" >&2; fi
            done
        fi
    done
    failed=()
    for i in "${!pids[@]}"; do
        wait "${pids[i]}" || failed+=("${selected[i]}")
    done
    for kind in "${failed[@]}"; do
        echo "images/build.sh: building $kind failed; the end of $logs/build-$kind.log:" >&2
        tail -n 40 "$logs/build-$kind.log" >&2
    done
    if ((${#failed[@]})); then
        echo "images/build.sh: not built: ${failed[*]} (logs in $logs)" >&2
        exit 1
    fi
fi

if ((push)); then
    for image in "${images[@]}"; do
        run "$docker" push "$image"
    done
fi

# How the pipeline picks these names up
training="$(image_of training)"
engine="$(image_of engine)"
mlflow="$(image_of mlflow)"
repository="${training%/*}"
tag="${training##*:}"
echo
if ((dry_run)); then
    echo "Dry run: nothing was built or pushed. The images:"
elif ((push)); then
    echo "Built and pushed:"
else
    echo "Built (push them with --push, after docker login to the registry):"
fi
for i in "${!selected[@]}"; do
    printf '  %-9s %s\n' "${selected[i]}" "${images[i]}"
done
cat <<EOF

Compile the pipeline with these names as its defaults:
  QATPIPE_IMAGE_REPOSITORY=$repository QATPIPE_IMAGE_TAG=$tag qatpipe compile -o pipelines/qat_pipeline.yaml
or choose them per run with the pipeline parameters:
  qatpipe submit --host KFP_URL training_image=$training engine_image=$engine
The MLflow tracking server's Deployment (manifests/) runs $mlflow.
EOF
