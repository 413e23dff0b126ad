#!/usr/bin/env bash
# The GPU test suite on the newest jax that pyproject allows, on the device machine, which has jax 0.11.2
# preinstalled and no network. Run here (a machine with PyPI), from anywhere in the repo:
#
#     bash benchmarks/newest_jax.sh [VERSION]   # download + tar + chunks + md5 into .jaxwhl/, print the device calls
#     bash benchmarks/newest_jax.sh --split     # only print the GPU test files split into PARTS parts
#
# VERSION defaults to the newest jax release (with jaxlib, jax-cudaNN-plugin and jax-cudaNN-pjrt of the same
# version) that pyproject's jax bound allows. The four wheels (~233 MB for 0.12) are larger than the 64 MiB a
# device call may carry, so they go as one tar split into CHUNK-byte parts (.jaxwhl/jaxXYY.tar.part-aa, -ab, ...),
# one carried per call, back to back on the same warm machine; each call copies its part to DEST outside the repo
# (a carried path replaces its folder, so parts left in the repo vanish at the next call), and the last call joins
# them, checks the md5, installs the wheels with `pip install --no-deps --target DEST/site` and checks that jax
# imports at VERSION and sees the GPU. The test calls then run with DEST/site first on PYTHONPATH and the repo
# after it. pytest-timeout, pytest-xdist and execnet wheels travel in the tar too and are installed (into
# DEST/site) only where the device's Python lacks them. Everything printed is also saved to .jaxwhl/jaxXYY.commands.txt.
#
# The test calls log with -v into $OUT and print only the count passed and the failures: a call cut by its time limit
# (xdist prints no summary then) still names every test that finished. On an H200 the whole suite takes more than
# 9 minutes even at -n 16 (16 workers share one GPU), hence three parts.
#
# The --split parts: the test files that hold gpu-marked tests (collected with PYTHON: .venv/bin/python by
# default), spread over PARTS parts by estimated time, longest first, each part under about 9 minutes at -n JOBS.
# The estimate is per test, by folder, from earlier H200 logs; SPLIT_LOGS="a.log b.log" uses the `--durations`
# lines of earlier runs' logs instead (the test calls printed here write them: --durations 0 --durations-min 5).
#
# Settings (environment): CUDA=13 (12 for the cuda12 wheels), PYVER=3.12 (the device's Python),
# PLATFORM=manylinux_2_27_x86_64, CHUNK=55000000 (bytes per part), DEST=/root/jaxXYY, PARTS=3, JOBS=8,
# TEST_TIMEOUT=420 (s per test: the GPU example compare takes ~220 s), RUN_TIMEOUT=560 (s per test call),
# PYTHON (collects the tests), HOST_PYTHON=python3 (evaluates pyproject's version bound).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# the parts live apart from .whl/ (the peers' wheels, carried whole): a carry of .whl would exceed 64 MiB
WHL=.jaxwhl
DPY=${DEVICE_PYTHON:-python3}  # the device's interpreter (it has no `python`)
CUDA=${CUDA:-13}
PYVER=${PYVER:-3.12}
PLATFORM=${PLATFORM:-manylinux_2_27_x86_64}
CHUNK=${CHUNK:-55000000}
PARTS=${PARTS:-3}
JOBS=${JOBS:-8}
TEST_TIMEOUT=${TEST_TIMEOUT:-420}
RUN_TIMEOUT=${RUN_TIMEOUT:-560}
HOST_PYTHON=${HOST_PYTHON:-python3}
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
PKGS=(jax jaxlib "jax-cuda${CUDA}-plugin" "jax-cuda${CUDA}-pjrt")
EXTRAS=(pytest-timeout pytest-xdist execnet)

die() { echo "newest_jax.sh: $*" >&2; exit 1; }

# The versions pip sees for a package on the device's Python and platform, newest first.
versions() {
    pip index versions "$1" --python-version "$PYVER" --implementation cp --platform "$PLATFORM" \
        --only-binary=:all: 2>/dev/null | sed -n 's/^Available versions: //p' | tr -d ' ' | tr , '\n'
}

# The newest version that all four packages have and that pyproject's jax specifier allows.
newest_allowed() {
    local spec common pkg
    spec=$(sed -n 's/^ *"jax\([<>=!~][^"]*\)",\{0,1\}$/\1/p' pyproject.toml | head -1)
    [[ -n $spec ]] || die "no jax bound found in pyproject.toml"
    common=$(versions jax)
    for pkg in "${PKGS[@]:1}"; do
        common=$(grep -Fxf <(versions "$pkg") <<<"$common" || true)
    done
    [[ -n $common ]] || die "pip found no jax version common to ${PKGS[*]} for Python $PYVER"
    "$HOST_PYTHON" -c '
import sys
try:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
except ImportError:
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.version import Version
ok = [v for v in sys.stdin.read().split() if Version(v) in SpecifierSet(sys.argv[1])]
print(max(ok, key=Version) if ok else "")' "$spec" <<<"$common"
}

# "count path" per test file that holds gpu-marked tests.
gpu_test_files() {
    local collected
    if collected=$("$PYTHON" -m pytest --collect-only -q -m gpu -p no:cacheprovider tests 2>/dev/null) \
            && grep -q '::' <<<"$collected"; then
        grep '::' <<<"$collected" | cut -d: -f1 | sort | uniq -c | awk '{print $1, $2}'
    else
        echo "newest_jax.sh: collecting with $PYTHON failed; counting 'mark.gpu' per file instead" >&2
        grep -rlE 'mark\.gpu' tests --include='*.py' | sort | while read -r f; do
            echo "$(grep -cE 'mark\.gpu' "$f") $f"
        done
    fi
}

# "part seconds path" lines: the files spread over PARTS parts by estimated serial seconds, longest first.
split_parts() {
    gpu_test_files | awk -v logs="${SPLIT_LOGS:-}" '
        BEGIN {
            n = split(logs, files, " ")
            for (i = 1; i <= n; i++) {
                while ((getline line < files[i]) > 0) {
                    # "123.45s call     tests/x.py::test[...]" (setup and teardown lines count too)
                    if (line ~ /^[0-9.]+s (setup|call|teardown) +tests\//) {
                        split(line, w, " "); split(w[3], p, "::")
                        logged[p[1]] += w[1] + 0
                    }
                }
                close(files[i])
            }
        }
        {
            count = $1; path = $2
            if (n > 0) {
                # A logged test under --durations-min took less than 5 s: 2 s each for the unlogged share.
                est = (path in logged) ? logged[path] + count : count * 2
            } else {
                # Seconds per test on an H200, by folder (from the logs of earlier runs): the GPU example runs
                # compile the GPU preset, the DoRA big shapes and the float64 guarantees are long, the rest short.
                per = 5
                if (path ~ /^tests\/examples\//) per = 180
                else if (path ~ /^tests\/dora\/test_guarantees/) per = 30
                else if (path ~ /^tests\/dora\//) per = 20
                else if (path ~ /^tests\/galore\//) per = 20
                est = count * per
            }
            print est, path
        }' | sort -k1,1nr -k2 | awk -v parts="$PARTS" '
        {
            best = 1
            for (k = 2; k <= parts; k++) if (total[k] < total[best]) best = k
            total[best] += $1
            print best, $1, $2
        }' | sort -k1,1n -k3
}

print_split() {
    local parts
    parts=$(split_parts)
    [[ -n $parts ]] || die "no gpu-marked tests found under tests/"
    awk -v jobs="$JOBS" '
        { s[$1] += $2; f[$1] = f[$1] " " $3; n[$1]++ }
        END {
            for (k = 1; k in s; k++)
                printf "# part %d: %d files, ~%d s of tests (~%d s at -n %d):%s\n", \
                    k, n[k], s[k], s[k] / jobs, jobs, f[k]
        }' <<<"$parts"
}

# The files of part $1, space-separated.
part_files() { awk -v k="$1" '$1 == k {printf "%s%s", sep, $3; sep = " "}' <<<"$PARTS_TABLE"; }

# The unconditional requirements of jax and jaxlib on other packages, as python tuples ("name", "min version").
requirements() {
    local w
    for w in "$1"/jax-*.whl "$1"/jaxlib-*.whl; do
        unzip -p "$w" '*.dist-info/METADATA' | sed -n 's/^Requires-Dist: \([^;]*\)$/\1/p'
    done | awk '
        function newer(a, b,    x, y, i) {
            split(a, x, "."); split(b, y, ".")
            for (i = 1; i <= 4; i++) { if (x[i] + 0 != y[i] + 0) return x[i] + 0 > y[i] + 0 }
            return 0
        }
        {
            name = $0; sub(/[<>=!~ \[].*/, "", name)
            name = tolower(name); gsub(/-/, "_", name)
            if (name ~ /^jax/) next
            v = "0"
            if (match($0, />=[0-9][0-9A-Za-z.]*/)) v = substr($0, RSTART + 2, RLENGTH - 2)
            if (!(name in min)) order[++n] = name
            if (!(name in min) || newer(v, min[name])) min[name] = v
        }
        END {
            for (i = 1; i <= n; i++) printf "%s(\047%s\047,\047%s\047)", (i > 1 ? "," : ""), order[i], min[order[i]]
        }'
}

if [[ ${1:-} == --split ]]; then
    print_split
    exit 0
fi
[[ ${1:-} != -* ]] || die "usage: bash benchmarks/newest_jax.sh [--split | VERSION]"

VERSION=${1:-$(newest_allowed)}
[[ -n $VERSION ]] || die "no jax version within pyproject's bound for Python $PYVER"
TAG=jax$(awk -F. '{printf "%d%02d", $1, $2}' <<<"$VERSION")
DEST=${DEST:-/root/$TAG}
STAGE=$WHL/$TAG
echo "jax $VERSION (cuda$CUDA, Python $PYVER) -> $WHL/$TAG.tar.part-*, installed on the device in $DEST/site" >&2

rm -rf "$STAGE" "$WHL/$TAG.tar" "$WHL/$TAG".tar.part-* "$WHL/$TAG.md5" "$WHL/$TAG.commands.txt"
mkdir -p "$STAGE/wheels/extra"
pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp --platform "$PLATFORM" \
    -d "$STAGE/wheels" "${PKGS[@]/%/==$VERSION}"
pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation py --platform any \
    -d "$STAGE/wheels/extra" "${EXTRAS[@]}"
REQS=$(requirements "$STAGE/wheels")
ls -l "$STAGE/wheels" "$STAGE/wheels/extra" >&2
# The same wheels give the same tar (and chunks, md5) on every run.
tar -cf "$WHL/$TAG.tar" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$STAGE" wheels
split -b "$CHUNK" -a 2 "$WHL/$TAG.tar" "$WHL/$TAG.tar.part-"
(cd "$WHL" && md5sum "$TAG.tar" "$TAG".tar.part-*) > "$WHL/$TAG.md5"
rm -rf "$STAGE" "$WHL/$TAG.tar"
mapfile -t CHUNKS < <(cd "$WHL" && ls "$TAG".tar.part-*)
md5_of() { awk -v f="$1" '$2 == f {print $1}' "$WHL/$TAG.md5"; }

PARTS_TABLE=$(split_parts)
[[ -n $PARTS_TABLE ]] || die "no gpu-marked tests found under tests/"

n=${#CHUNKS[@]}
{
echo "# jax $VERSION for the GPU tests: $n calls to the same warm machine, back to back, then $PARTS test calls."
echo "# Each call: carry = the one path shown, command = the line under it. md5 of $TAG.tar: $(md5_of "$TAG.tar")"
echo "# A call that finds an earlier part missing (md5sum: No such file) means the machine went cold: start at 1."
for i in "${!CHUNKS[@]}"; do
    c=${CHUNKS[$i]}
    echo
    echo "## call $((i + 1)) of $n: carry [\"$WHL/$c\"] ($(stat -c %s "$WHL/$c") bytes, md5 $(md5_of "$c"))"
    fresh=""
    [[ $i -eq 0 ]] && fresh="rm -rf $DEST; "
    copy="set -euo pipefail; R=\$PWD; D=$DEST; ${fresh}mkdir -p \$D; cp $WHL/$c \$D/; cd \$D"
    if [[ $i -lt $((n - 1)) ]]; then
        echo "$copy; echo '$(md5_of "$c")  $c' | md5sum -c; ls -l \$D"
        continue
    fi
    sums=""
    for p in "${CHUNKS[@]}"; do sums+="$(md5_of "$p")  $p\n"; done
    # pip where the device's Python has it, else the wheels unzipped (none of them has a .data folder).
    inst="inst() { $DPY -m pip install -q --no-deps --no-index --no-compile --target \$D/site \"\$@\""
    inst+=" || for w; do $DPY -m zipfile -e \"\$w\" \$D/site; done; }"
    x=w/wheels/extra
    check="import sys,jax,jaxlib,importlib.metadata as m; print(sys.executable, 'jax', jax.__version__,"
    check+=" 'jaxlib', jaxlib.__version__, 'plugin', m.version('jax-cuda${CUDA}-plugin'),"
    check+=" 'pjrt', m.version('jax-cuda${CUDA}-pjrt')); print(jax.__file__); d=jax.devices(); print(d);"
    check+=" import jax.numpy as jnp; print(float(jnp.arange(8.0).sum())); I={};"
    check+=" [I.setdefault((x.metadata['Name'] or '').lower().replace('-','_'), x.version) for x in m.distributions()];"
    check+=" V=lambda s: tuple(int(p) for p in s.split('.')[:3] if p.isdigit());"
    check+=" [print('requires', k, '>=', v, 'found', I.get(k), 'ok' if I.get(k) and V(I[k]) >= V(v) else 'NOT MET')"
    check+=" for k, v in [$REQS]]; assert jax.__version__ == '$VERSION' and d[0].platform == 'gpu'"
    echo "$copy; printf '$sums' | md5sum -c; cat $TAG.tar.part-* > $TAG.tar;" \
         "echo '$(md5_of "$TAG.tar")  $TAG.tar' | md5sum -c; rm -rf w site; mkdir w; tar -xf $TAG.tar -C w;" \
         "$inst; inst w/wheels/*.whl; $DPY -c 'import pytest_timeout' 2>/dev/null || inst $x/pytest_timeout-*.whl;" \
         "$DPY -c 'import xdist' 2>/dev/null || inst $x/pytest_xdist-*.whl $x/execnet-*.whl;" \
         "rm -rf w $TAG.tar; ls \$D/site; cd \$R; PYTHONPATH=\$D/site:\$R $DPY -c \"$check\""
done
for k in $(seq 1 "$PARTS"); do
    echo
    echo "## test call $k of $PARTS (no carry; right after the calls above, on the same warm machine)"
    echo "set -o pipefail; D=$DEST;" \
         "test -d \$D/site || { echo \"no \$D/site: the machine went cold, redo the copy calls\"; exit 1; };" \
         "L=\$OUT/gpu_tests_${TAG}_part$k.log; (PYTHONPATH=\$D/site:\$PWD $DPY -c 'import jax; print(\"jax\"," \
         "jax.__version__, jax.devices())'; PYTHONPATH=\$D/site:\$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false" \
         "timeout -s INT -k 15 $RUN_TIMEOUT $DPY -m pytest -v --tb=short -m gpu -n $JOBS --timeout $TEST_TIMEOUT" \
         "--durations 0 --durations-min 5 -p no:cacheprovider $(part_files "$k")) > \$L 2>&1;" \
         "grep -cE ' PASSED ' \$L; grep -E ' (FAILED|ERROR) |^(FAILED|ERROR) |[0-9]+ (passed|failed)' \$L | tail -40"
done
echo
print_split
} | tee "$WHL/$TAG.commands.txt"
awk '!/^#/ && length($0) > 2000 {print "newest_jax.sh: a device command has " length($0) " characters, over 2,000"}' \
    "$WHL/$TAG.commands.txt" >&2
