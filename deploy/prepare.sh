#!/bin/sh
# The images' entrypoint (deploy/Dockerfile): installs what the containers' environment asks for,
# then runs the container's command (`dask scheduler ...`, `dask worker ...`) in its place, as the
# official Dask image's prepare.sh does.
#
#   EXTRA_PIP_PACKAGES="optax equinox>=0.13"   pip requirements, separated by spaces, installed
#                                              at every start, within the image's pins
#
# The packages are installed with `pip install -c constraints.txt` (the file beside this script,
# or $DASKDAG_CONSTRAINTS), so none can change the versions the image pins (jax, jaxlib, dask,
# distributed, cloudpickle, ...: a client and every worker must agree on them); one that needs
# other versions fails here. pip reads its usual environment too (PIP_INDEX_URL, PIP_TARGET,
# ...). The images run as the unprivileged user `dask`: pip installs into its home
# (~/.local, "Defaulting to user installation"), which Python reads at start.
#
# If pip cannot install them, the container exits non-zero with a message naming them, rather
# than start a worker whose tasks would fail on import. Installing at start needs the package
# index at every start and delays it; for production, build them into an image of your own
# (docs/guides/deployment.md, "Images": a FROM layer with the same constraints).
#
# EXTRA_APT_PACKAGES and EXTRA_CONDA_PACKAGES, which the Dask image also reads, are refused
# here: these images have no conda, and run as a user that cannot apt-get. Add system
# packages in a FROM layer.
set -eu
set -f  # requirements such as "equinox[docs]" are not file patterns

if [ "$#" -eq 0 ]; then
    echo "prepare.sh: no command to run (e.g. dask worker tls://scheduler:8786 ...)" >&2
    exit 2
fi

for var in EXTRA_APT_PACKAGES EXTRA_CONDA_PACKAGES; do
    eval "value=\${$var:-}"
    if [ -n "$value" ]; then
        echo "prepare.sh: $var=\"$value\" is not supported by daskdag's images (no conda; they" \
             "run as an unprivileged user): install it in a FROM layer (docs/guides/deployment.md)" >&2
        exit 1
    fi
done

if [ -n "${EXTRA_PIP_PACKAGES:-}" ]; then
    constraints="${DASKDAG_CONSTRAINTS:-$(dirname "$0")/constraints.txt}"
    echo "prepare.sh: installing EXTRA_PIP_PACKAGES=\"$EXTRA_PIP_PACKAGES\" (pins: $constraints)" >&2
    # Word splitting is wanted: one requirement per word, as in the Dask image.
    # shellcheck disable=SC2086
    if ! python -m pip install --no-input --disable-pip-version-check -c "$constraints" \
            $EXTRA_PIP_PACKAGES >&2; then
        echo "prepare.sh: pip could not install EXTRA_PIP_PACKAGES=\"$EXTRA_PIP_PACKAGES\" within" \
             "the pins of $constraints (pip's message is above); not starting: $*" >&2
        exit 1
    fi
fi

exec "$@"
