#!/bin/sh
# Build step of the datapath image: install bcc, iproute2 and gobgpd (the BGP
# speaker, flagella.datapath.bgp) from the Debian
# packages scripts/images put in /tmp/debs/datapath (offline), or from the
# network when that folder is empty; unpack the kernel headers of
# /tmp/debs/headers into one merged tree bcc can use as BCC_KERNEL_SOURCE
# (Debian splits them into an -amd64 and a -common package); link bcc's
# Python module into the venv.
set -eu
PACKAGES="python3-bpfcc libbpfcc iproute2 gobgpd"
export DEBIAN_FRONTEND=noninteractive
if ls /tmp/debs/datapath/*.deb >/dev/null 2>&1; then
  # apt orders the unpacking (pre-dependencies) and needs no package lists here.
  apt-get install -y -qq --no-install-recommends /tmp/debs/datapath/*.deb >/dev/null
  rm -rf /var/cache/apt/archives/*.deb /var/lib/apt/lists/*
else
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $PACKAGES >/dev/null
  rm -rf /var/lib/apt/lists/*
fi
# Headers: Debian's linux-headers-<ver>-common then -<ver>-amd64 on top.
mkdir -p /tmp/headers /opt/flagella/kernel-headers
if ! ls /tmp/debs/headers/*.deb >/dev/null 2>&1; then
  (cd /tmp/debs/headers && apt-get update -qq \
    && ver=$(apt-cache depends linux-headers-amd64 | sed -n 's/.*Depends: linux-headers-\(.*\)-amd64$/\1/p' | head -1) \
    && apt-get download "linux-headers-$ver-amd64" "linux-headers-$ver-common" \
    && rm -rf /var/lib/apt/lists/*)
fi
for deb in /tmp/debs/headers/*.deb; do dpkg-deb -x "$deb" /tmp/headers; done
common=$(ls -d /tmp/headers/usr/src/linux-headers-*-common | head -1)
arch=$(ls -d /tmp/headers/usr/src/linux-headers-*-amd64 | head -1)
cp -a "$common/." /opt/flagella/kernel-headers/
cp -a "$arch/." /opt/flagella/kernel-headers/
# kbuild tooling links (scripts, tools) point outside: not needed by bcc.
rm -f /opt/flagella/kernel-headers/scripts /opt/flagella/kernel-headers/tools
basename "$arch" | sed 's/^linux-headers-//' >/opt/flagella/kernel-headers/VERSION
rm -rf /tmp/headers
# bcc is not on PyPI: Debian's pure-Python module, linked into the venv.
site=$(/opt/flagella/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
ln -sfn /usr/lib/python3/dist-packages/bcc "$site/bcc"
/opt/flagella/bin/python -c 'import bcc, pyroute2' 
ip -V >/dev/null
