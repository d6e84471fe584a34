#!/bin/sh
# flagella-install-cni: install the flagella-cni plugin and its network
# configuration on the node (the datapath DaemonSet's init container).
#
#   CNI_BIN_DIR        the node's CNI bin folder, mounted  (default /host/opt/cni/bin)
#   CNI_CONF_DIR       the node's CNI config folder, mounted (default /host/etc/cni/net.d)
#   FLAGELLA_CNI_SOCKET     the node's socket the datapath serves the plugin on
#                           (default /run/flagella/cni.sock, the datapath's default)
#   FLAGELLA_CNI_CONFLIST   file name of the conflist (default 05-flagella.conflist)
#   FLAGELLA_CNI_MTU        pod interface MTU (default 1500)
#   FLAGELLA_CNI_KUBERNETES true: pods' identity labels come from the API server
#                           (their Pod and Namespace, followed by the endpoint
#                           service); false: from the CNI arguments (default true)
#
# The plugin talks only to its node's datapath, over that socket: the
# conflist names no service address and no node.
#
# Each file is written under a temporary name and renamed, so the runtime
# never executes a half-copied plugin or reads a half-written conflist.
set -eu
bin=${CNI_BIN_DIR:-/host/opt/cni/bin}
conf=${CNI_CONF_DIR:-/host/etc/cni/net.d}
src=/opt/flagella/cni
socket=${FLAGELLA_CNI_SOCKET:-/run/flagella/cni.sock}
name=${FLAGELLA_CNI_CONFLIST:-05-flagella.conflist}
mtu=${FLAGELLA_CNI_MTU:-1500}
kubernetes=${FLAGELLA_CNI_KUBERNETES:-true}
case "$kubernetes" in
  true|false) ;;
  *) echo "FLAGELLA_CNI_KUBERNETES=$kubernetes is neither true nor false" >&2; exit 1 ;;
esac
case "$socket" in
  /*) ;;
  *) echo "FLAGELLA_CNI_SOCKET=$socket is not an absolute path" >&2; exit 1 ;;
esac
mkdir -p "$bin" "$conf"

rm -rf "$bin/.flagella-cni.new" "$bin/.flagella-cni.old"
cp -R "$src/.flagella-cni" "$bin/.flagella-cni.new"
if [ -e "$bin/.flagella-cni" ]; then mv "$bin/.flagella-cni" "$bin/.flagella-cni.old"; fi
mv "$bin/.flagella-cni.new" "$bin/.flagella-cni"
rm -rf "$bin/.flagella-cni.old"
cp "$src/flagella-cni" "$bin/.flagella-cni.tmp"
chmod 0755 "$bin/.flagella-cni.tmp"
mv -f "$bin/.flagella-cni.tmp" "$bin/flagella-cni"

cat >"$conf/.$name.tmp" <<JSON
{
  "cniVersion": "1.1.0",
  "name": "flagella",
  "plugins": [
    {
      "type": "flagella-cni",
      "socket": "$socket",
      "mtu": $mtu,
      "kubernetes": $kubernetes
    }
  ]
}
JSON
mv -f "$conf/.$name.tmp" "$conf/$name"

# The installed plugin must run on the node as the runtime will run it.
version=$(echo '{"cniVersion":"1.1.0"}' | CNI_COMMAND=VERSION "$bin/flagella-cni")
echo "{\"level\":\"info\",\"msg\":\"installed flagella-cni\",\"bin\":\"$bin\",\"conflist\":\"$conf/$name\",\"socket\":\"$socket\",\"version\":$version}"
