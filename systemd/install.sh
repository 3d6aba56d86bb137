#!/usr/bin/env bash
# `make install`: eagle3d as a systemd service.
#   /opt/eagle3d                        a venv with eagle3d (+ the engine and SGLang extras)
#   /etc/eagle3d/eagle3d.toml           the config, from etc/eagle3d.toml; an existing one is
#                                       never overwritten (the new template goes beside it, .new)
#   /usr/lib/systemd/system/eagle3d.service  the unit, in the distribution's unit folder
#                                       (systemd/paths.sh); overrides go in drop-ins under
#                                       /etc/systemd/system/eagle3d.service.d/
#   /usr/lib/tmpfiles.d/eagle3d.conf    the spool /dev/shm/eagle3d, the service's before anyone's
#   /data/eagle3d/{dataset,train}       the folders the unit lets the service write
#   /usr/local/bin/eagle3ctl            the status tool, linked from the venv
#   /usr/share/bash-completion/completions/eagle3ctl  its bash completion (systemd/paths.sh)
#   user and group eagle3d              the service's own, with the GPU device groups
# Environment: PYTHON (python3) builds the venv; EXTRAS (engine,sglang) are the extras installed.
# DESTDIR stages the files under another root for a package or image build: no user, no
# ownership, no venv (built where it runs: its scripts hold absolute paths), no systemctl.
set -euo pipefail

SRC=$(cd "$(dirname "$0")/.." && pwd)
source "$SRC/systemd/paths.sh"
DESTDIR=${DESTDIR:-}
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS:-engine,sglang}
USER_NAME=eagle3d
VENV=/opt/eagle3d
CONFIG_DIR=/etc/eagle3d
DATA_DIRS=(/data/eagle3d /data/eagle3d/dataset /data/eagle3d/train)

staging() { [[ -n $DESTDIR ]]; }

# Ownership is set only on the target machine: when staging, the user does not exist yet.
# The config is root's to edit and the service's to read; the data folders are the service's.
if staging; then
    CONFIG_OWNER=() DATA_OWNER=()
else
    CONFIG_OWNER=(-o root -g "$USER_NAME") DATA_OWNER=(-o "$USER_NAME" -g "$USER_NAME")
fi

if ! staging && [[ $(id -u) != 0 ]]; then
    echo "install.sh: run as root (sudo make install), or set DESTDIR to stage the files" >&2
    exit 1
fi

if ! staging; then
    if ! getent passwd "$USER_NAME" >/dev/null; then
        # Home = the StateDirectory, so caches written under ~ stay inside what the unit allows.
        useradd --system --user-group --home-dir /var/lib/eagle3d --no-create-home \
            --shell /usr/sbin/nologin --comment "eagle3d pipeline" "$USER_NAME"
    fi
    # Distributions that restrict /dev/nvidia* or /dev/dri give access through these groups.
    for group in video render; do
        if getent group "$group" >/dev/null; then usermod -aG "$group" "$USER_NAME"; fi
    done

    [[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade "$SRC${EXTRAS:+[$EXTRAS]}"
fi

install -d -m 0750 "${CONFIG_OWNER[@]}" "$DESTDIR$CONFIG_DIR"
config=$DESTDIR$CONFIG_DIR/eagle3d.toml
if [[ ! -e $config ]]; then
    install -m 0640 "${CONFIG_OWNER[@]}" "$SRC/etc/eagle3d.toml" "$config"
    echo "installed $CONFIG_DIR/eagle3d.toml: edit [target] model and [data] source, then start"
elif ! cmp -s "$SRC/etc/eagle3d.toml" "$config"; then
    install -m 0640 "${CONFIG_OWNER[@]}" "$SRC/etc/eagle3d.toml" "$config.new"
    echo "kept your $CONFIG_DIR/eagle3d.toml; the current template is $CONFIG_DIR/eagle3d.toml.new"
fi

for dir in "${DATA_DIRS[@]}"; do
    install -d -m 0750 "${DATA_OWNER[@]}" "$DESTDIR$dir"
done

install -D -m 0644 "$SRC/docs/operations.md" "$DESTDIR$VENV/share/doc/eagle3d/operations.md"
install -D -m 0644 "$SRC/systemd/eagle3d.service" "$DESTDIR$UNIT_DIR/eagle3d.service"
install -D -m 0644 "$SRC/systemd/eagle3d-tmpfiles.conf" "$DESTDIR$TMPFILES_DIR/eagle3d.conf"
remove_legacy "$DESTDIR"
# eagle3ctl on the operators' PATH; the daemon itself is started by the unit only.
install -d "$DESTDIR/usr/local/bin"
ln -sfn "$VENV/bin/eagle3ctl" "$DESTDIR/usr/local/bin/eagle3ctl"
# Its completion, drawn from the installed eagle3ctl's own parser when bash-completion first
# loads it (one Tab per shell): written so, it holds no copy that an upgrade would leave stale,
# and it needs no venv when staging.
install -d "$DESTDIR$COMPLETION_DIR"
cat >"$DESTDIR$COMPLETION_DIR/eagle3ctl" <<EOF
# eagle3d: eagle3ctl's completion, from the installed program's parser (systemd/install.sh)
eval "\$($VENV/bin/eagle3ctl --print-completion bash)"
EOF

if ! staging && [[ -d /run/systemd/system ]]; then
    systemctl daemon-reload
fi
if ! staging; then
    # The spool now, not at the next boot: a local user cannot take the name meanwhile.
    systemd-tmpfiles --create eagle3d.conf
fi
echo "eagle3d installed. New install: edit $CONFIG_DIR/eagle3d.toml, then"
echo "  systemctl enable --now eagle3d"
echo "Upgrade: systemctl restart eagle3d (a running daemon keeps the old code until then)."
