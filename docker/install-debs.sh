#!/bin/sh
# Install the .deb files of folder $1 (fetched on the host by scripts/images,
# with their dependencies) offline, letting no maintainer script start a
# service (policy-rc.d), then remove the folder.
set -eu
printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
chmod +x /usr/sbin/policy-rc.d
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$1"/*.deb >/dev/null
rm -rf "$1" /usr/sbin/policy-rc.d
