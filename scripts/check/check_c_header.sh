#!/usr/bin/env bash
# Checks the C interface: vmmbuf-torch/include/vmmbuf.h declares exactly the
# vmmbuf_* functions the plug-in library exports (no more, no fewer), it
# compiles as C and as C++, and a C program built against it alone runs
# against the library (vmmbuf-torch/tests/c/header_use.c).
# Usage: scripts/check/check_c_header.sh LIBRARY [BUILD_DIR]
#   LIBRARY: a libvmmbuf_torch.so (cargo's, or the Python package's native
#   module); with BUILD_DIR, the C program is built there and run against
#   LIBRARY (which must then be cargo's, without the Python module).
set -euo pipefail
cd "$(dirname "$0")/../.."
so=$1
header=vmmbuf-torch/include/vmmbuf.h
declared=$(grep -vE '^\s*(/\*|\*)' "$header" | grep -oE '\bvmmbuf_[a-z_]+\(' | tr -d '(' | sort -u)
exported=$(nm -D --defined-only "$so" | awk '{print $3}' | grep '^vmmbuf_' | sort -u)
if [ "$declared" != "$exported" ]; then
  echo "vmmbuf.h and $so disagree (< declared only, > exported only):"
  diff <(echo "$declared") <(echo "$exported") || true
  exit 1
fi
echo "vmmbuf.h: $(echo "$declared" | wc -l) functions, exactly what $(basename "$so") exports"
cc -fsyntax-only -Wall -Wextra -Werror -std=c11 -x c "$header"
c++ -fsyntax-only -Wall -Wextra -Werror -x c++ "$header"
if [ $# -ge 2 ]; then
  out=$2
  cc -Wall -Wextra -Werror -std=c11 -Ivmmbuf-torch/include vmmbuf-torch/tests/c/header_use.c \
    -L"$(dirname "$so")" -lvmmbuf_torch -o "$out/header_use"
  LD_LIBRARY_PATH="$(dirname "$so")" VMMBUF_LOG=off "$out/header_use"
fi
