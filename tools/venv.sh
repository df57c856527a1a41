# Sourced by tools/test, tools/demo and the other tools: one cached virtual
# environment per TensorFlow version (and build), with deferred_grad
# installed from this checkout.
#
# DEFERRED_GRAD_CACHE  where the environments live (default ~/.cache/deferred_grad)
# DEFERRED_GRAD_PYTHON the Python to build them with (default: python3, else
#                      the first of python3.11/3.10/3.9 that the version has
#                      wheels for: TensorFlow 2.15 for Python 3.9 to 3.11,
#                      TensorFlow 2.21 for Python 3.10 to 3.13).

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${DEFERRED_GRAD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/deferred_grad}

_python_minor() { "$1" -c 'import sys; print(sys.version_info[1])' 2>/dev/null; }

# Prints a Python that TensorFlow $1 has wheels for.
python_for() {
  local version=$1 min_minor=10 max_minor=13 candidate minor
  case $version in 2.15.*) min_minor=9; max_minor=11 ;; esac
  for candidate in ${DEFERRED_GRAD_PYTHON:-} python3 python3.11 python3.10 python3.12 python3.13 python3.9; do
    command -v "$candidate" >/dev/null 2>&1 || continue
    minor=$(_python_minor "$candidate") || continue
    if [ -n "$minor" ] && [ "$minor" -ge "$min_minor" ] && [ "$minor" -le "$max_minor" ]; then
      command -v "$candidate"
      return 0
    fi
  done
  echo "no Python 3.$min_minor-3.$max_minor found for TensorFlow $version; set DEFERRED_GRAD_PYTHON" >&2
  return 1
}

# Creates (once) the environment for TensorFlow $1, installs this checkout
# into it, and prints its path. $2 "cuda" makes one with TensorFlow's CUDA
# build and libraries (tensorflow[and-cuda], Linux) instead of the CPU build.
ensure_venv() {
  local version=$1 flavour=${2:-} python requirements venv package=tensorflow-cpu
  [ "$flavour" = cuda ] && package="tensorflow[and-cuda]"
  python=$(python_for "$version") || return 1
  requirements="$package==$version six absl-py pytest setuptools wheel"
  # Keras 2 for the model.fit tests: TensorFlow 2.15 bundles it as tf.keras;
  # from 2.16 on it is the tf_keras package of the same version, installed
  # without its dependencies (it asks for the full tensorflow package, which
  # would land on top of tensorflow-cpu).
  local extras=""
  case $version in
    2.15.*) requirements="$requirements tensorflow-estimator==2.15.0" ;;
    *) extras="tf_keras==$version" ;;
  esac
  local recorded="$requirements${extras:+ $extras}"
  venv=$cache/venv-tf$version${flavour:+-$flavour}-py$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  if [ "$(cat "$venv/.requirements" 2>/dev/null)" != "$recorded" ]; then
    echo "setting up $venv (once; TensorFlow is a large download)" >&2
    rm -rf "$venv"
    "$python" -m venv "$venv" >&2 || return 1
    "$venv/bin/pip" install --quiet --disable-pip-version-check $requirements >&2 || return 1
    if [ -n "$extras" ]; then
      # Some TensorFlow patch releases (2.18.1) have no tf_keras of their own:
      # then the newest tf_keras of the same minor version.
      "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps $extras >&2 ||
        "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps \
          "tf_keras==${version%.*}.*" >&2 || return 1
    fi
    echo "$recorded" > "$venv/.requirements"
  fi
  # Install, not import from the tree: the tests then also check packaging.
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps \
    --no-build-isolation --force-reinstall "$repo" >&2 || return 1
  rm -rf "$repo/build" "$repo"/*.egg-info
  echo "$venv"
}
