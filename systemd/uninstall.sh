#!/usr/bin/env bash
# `make uninstall`: stops and removes the service, the venv and the spool. Keeps what took work
# to make: the config and drop-ins (your edits), /var/lib/eagle3d (the ledger), /data/eagle3d (the
# dataset: days of GPU time) and the eagle3d user that owns them. It prints how to remove those
# by hand.
# DESTDIR: as in install.sh.
set -euo pipefail

DESTDIR=${DESTDIR:-}
source "$(cd "$(dirname "$0")" && pwd)/paths.sh"

if [[ -z $DESTDIR && $(id -u) != 0 ]]; then
    echo "uninstall.sh: run as root (sudo make uninstall)" >&2
    exit 1
fi

if [[ -z $DESTDIR && -d /run/systemd/system ]]; then
    # Stops the daemon (and with it the engine and trainer) before its files go.
    systemctl disable --now eagle3d.service || true
fi
rm -f "$DESTDIR$UNIT_DIR/eagle3d.service" "$DESTDIR$TMPFILES_DIR/eagle3d.conf"
remove_legacy "$DESTDIR"
rm -f "$DESTDIR/usr/local/bin/eagle3ctl" "$DESTDIR$COMPLETION_DIR/eagle3ctl"
rm -rf "$DESTDIR/opt/eagle3d"
# The spool of the production config: dumps not yet ingested, which the ledger has put back to
# extract again. A spool_dir elsewhere is left to the operator.
rm -rf "$DESTDIR/dev/shm/eagle3d"
if [[ -z $DESTDIR && -d /run/systemd/system ]]; then
    systemctl daemon-reload
fi

cat <<'MSG'
eagle3d uninstalled. Kept, remove by hand if no longer wanted:
  /etc/eagle3d              rm -r /etc/eagle3d
MSG
# `systemctl edit eagle3d` writes here; a new `make install` takes them up again.
if [[ -d $DESTDIR/etc/systemd/system/eagle3d.service.d ]]; then
    echo "  /etc/systemd/system/eagle3d.service.d   rm -r /etc/systemd/system/eagle3d.service.d   (your drop-ins)"
fi
cat <<'MSG'
  /var/lib/eagle3d          rm -r /var/lib/eagle3d   (the ledger: the dataset resumes from it)
  /data/eagle3d             rm -r /data/eagle3d      (the dataset and trained drafters)
  user eagle3d              userdel eagle3d
MSG
