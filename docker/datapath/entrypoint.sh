#!/bin/sh
# Entry point of the datapath image: choose the kernel headers bcc compiles
# against, then become the datapath service (exec: it is PID 1 and handles
# SIGTERM itself). Arguments go to `python -m flagella.datapath`.
#
# bcc looks in /lib/modules/$(uname -r)/build (and .../source for Debian's
# split headers). Mount the host's /lib/modules and /usr/src read-only at the
# same paths and the host's headers are used; without them (or with
# FLAGELLA_KERNEL_HEADERS=shipped) the Debian headers shipped in the image are.
set -eu
kdir=/lib/modules/$(uname -r)
shipped=/opt/flagella/kernel-headers
if [ -z "${BCC_KERNEL_SOURCE:-}" ]; then
  if [ "${FLAGELLA_KERNEL_HEADERS:-auto}" != shipped ] && [ -d "$kdir/build/include" ]; then
    :
  else
    export BCC_KERNEL_SOURCE=$shipped
    echo "{\"level\":\"info\",\"service\":\"flagella-datapath\",\"msg\":\"no kernel headers for $(uname -r) from the host: using the shipped $(cat $shipped/VERSION)\"}" >&2
  fi
fi
exec /opt/flagella/bin/python -m flagella.datapath "$@"
