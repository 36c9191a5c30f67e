#!/usr/bin/env bash
# Holds libepdclient.so's exported surface (CTest install.exports):
#   tests/install/check_exports.sh LIBEPDCLIENT_SO EPD_H
# the dynamic symbol table defines only the C ABI (epd_*, client/epdclient.map) besides the
# linker's own _init/_fini, every function EPD_H declares with EPD_API among them, and the
# SONAME is libepdclient.so.<major>.
set -euo pipefail
lib=${1:?usage: check_exports.sh LIBEPDCLIENT_SO EPD_H}
header=${2:?usage: check_exports.sh LIBEPDCLIENT_SO EPD_H}
fail() { echo "check_exports.sh: $*" >&2; exit 1; }
[[ -f "$lib" ]] || fail "$lib: no such file"

mapfile -t defined < <(nm -D --defined-only "$lib" | awk '{print $NF}' | sed 's/@.*//' | sort -u)
stray=()
for s in "${defined[@]}"; do
  case "$s" in
    epd_* | _init | _fini) ;;
    *) stray+=("$s") ;;
  esac
done
if ((${#stray[@]} > 0)); then
  echo "check_exports.sh: $lib exports ${#stray[@]} symbol(s) outside the C ABI:" >&2
  printf '  %s\n' "${stray[@]:0:40}" >&2
  fail "only epd_* may be exported (EPD_API in epd/epd.h, client/epdclient.map)"
fi
mapfile -t declared < <(grep -oE 'EPD_API [^(]*\(' "$header" | grep -oE 'epd_[a-z0-9_]+\($' |
  tr -d '(' | sort -u)
((${#declared[@]} > 0)) || fail "$header declares no EPD_API function"
for s in "${declared[@]}"; do
  printf '%s\n' "${defined[@]}" | grep -qx "$s" || fail "$lib does not export $s ($header)"
done

soname=$(objdump -p "$lib" | awk '$1 == "SONAME" {print $2}')
[[ "$soname" =~ ^libepdclient\.so\.[0-9]+$ ]] || fail "$lib: SONAME '$soname', expected libepdclient.so.<major>"
n_epd=$(printf '%s\n' "${defined[@]}" | grep -c '^epd_')
echo "check_exports.sh: $lib ($soname) exports $n_epd epd_* symbols and nothing else"
