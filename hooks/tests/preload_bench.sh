#!/bin/sh
# What /etc/ld.so.preload naming libvgpu adds to every exec, in a process that
# never loads CUDA.  Prints one line per program and preload (none, an empty
# library, libvgpu): "PROGRAM PRELOAD WALL_NS CPU_NS", the median over 5
# interleaved rounds of the mean per exec (CPU: user + system of the started
# processes).  Needs root and unshare(1): the preload file exists only in a
# private mount namespace (an overlay over /etc), never on the machine; prints
# nothing where that is not possible.
set -eu
build=$(cd "${1:-build}" && pwd)
rounds=${ROUNDS:-5} n_true=${N_TRUE:-1000} n_py=${N_PY:-40}
[ "$(id -u)" = 0 ] && command -v unshare >/dev/null 2>&1 || exit 0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
unshare -m --propagation private sh -s "$build" "$work" "$rounds" "$n_true" "$n_py" <<'NS'
set -eu
build=$1 work=$2 rounds=$3 n_true=$4 n_py=$5
mount -t tmpfs tmpfs "$work"
mkdir "$work/u" "$work/w" "$work/r"
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$work/u,workdir=$work/w" /etc
py=$(command -v python3 || echo /bin/true)
i=0
while [ $i -lt "$rounds" ]; do
    for preload in none empty vgpu; do
        case $preload in
            none) rm -f /etc/ld.so.preload ;;
            empty) echo "$build/libempty.so" > /etc/ld.so.preload ;;
            vgpu) echo "$build/libvgpu.so" > /etc/ld.so.preload ;;
        esac
        "$build/exec_loop" "$n_true" /bin/true >> "$work/r/true.$preload"
        "$build/exec_loop" "$n_py" "$py" -c pass >> "$work/r/python3.$preload"
    done
    i=$((i + 1))
done
rm -f /etc/ld.so.preload
mid=$(( (rounds + 1) / 2 ))
for program in true python3; do
    for preload in none empty vgpu; do
        wall=$(cut -d' ' -f1 "$work/r/$program.$preload" | sort -n | sed -n "${mid}p")
        cpu=$(cut -d' ' -f2 "$work/r/$program.$preload" | sort -n | sed -n "${mid}p")
        echo "$program $preload $wall $cpu"
    done
done
NS
