#!/usr/bin/env bash
# `make uninstall`: stops and removes the service and the venv. Keeps what took work to make:
# the config (your edits), /var/lib/eagle3d (the ledger), /data/eagle3d (the dataset: days of
# GPU time) and the eagle3d user that owns them. It prints how to remove those by hand.
# DESTDIR: as in install.sh.
set -euo pipefail

DESTDIR=${DESTDIR:-}

if [[ -z $DESTDIR && $(id -u) != 0 ]]; then
    echo "uninstall.sh: run as root (sudo make uninstall)" >&2
    exit 1
fi

if [[ -z $DESTDIR && -d /run/systemd/system ]]; then
    # Stops the daemon (and with it the engine and trainer) before its files go.
    systemctl disable --now eagle3d.service || true
fi
rm -f "$DESTDIR/etc/systemd/system/eagle3d.service"
rm -f "$DESTDIR/usr/local/bin/eagle3ctl"
rm -rf "$DESTDIR/opt/eagle3d"
if [[ -z $DESTDIR && -d /run/systemd/system ]]; then
    systemctl daemon-reload
fi

cat <<'MSG'
eagle3d uninstalled. Kept, remove by hand if no longer wanted:
  /etc/eagle3d              rm -r /etc/eagle3d
  /var/lib/eagle3d          rm -r /var/lib/eagle3d   (the ledger: the dataset resumes from it)
  /data/eagle3d             rm -r /data/eagle3d      (the dataset and trained drafters)
  user eagle3d              userdel eagle3d
MSG
