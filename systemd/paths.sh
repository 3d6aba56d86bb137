# Where the distribution keeps units, tmpfiles.d entries and bash completions that packages
# install (the "vendor" folders; /etc/systemd/system and /etc/tmpfiles.d are the administrator's,
# for overrides and drop-ins): systemd's and bash-completion's pkg-config files say, else the
# places every such distribution has. Sourced by install.sh and uninstall.sh; UNIT_DIR,
# TMPFILES_DIR and COMPLETION_DIR may be set to override.
vendor_dir() {  # PACKAGE VARIABLE FALLBACK
    pkg-config --variable="$2" "$1" 2>/dev/null | grep . || echo "$3"
}
UNIT_DIR=${UNIT_DIR:-$(vendor_dir systemd systemdsystemunitdir /usr/lib/systemd/system)}
TMPFILES_DIR=${TMPFILES_DIR:-$(vendor_dir systemd tmpfilesdir /usr/lib/tmpfiles.d)}
COMPLETION_DIR=${COMPLETION_DIR:-$(vendor_dir bash-completion completionsdir \
    /usr/share/bash-completion/completions)}
# Where installs before 2026-12-06 put them; a file there overrides the vendor one.
LEGACY_UNIT=/etc/systemd/system/eagle3d.service
LEGACY_TMPFILES=/etc/tmpfiles.d/eagle3d.conf

remove_legacy() {  # DESTDIR: an earlier install's copies, where they are ours (first line)
    local file
    for file in "$1$LEGACY_UNIT" "$1$LEGACY_TMPFILES"; do
        if [[ -f $file ]] && head -n 1 "$file" | grep -q "^# eagle3d"; then
            rm -f "$file"
            echo "removed ${file#"$1"} of an earlier install (now under $UNIT_DIR and $TMPFILES_DIR)"
        fi
    done
}
