# Where the distribution keeps units and tmpfiles.d entries that packages install (the "vendor"
# folders; /etc/systemd/system and /etc/tmpfiles.d are the administrator's, for overrides and
# drop-ins): systemd's pkg-config file says, else the places every systemd distribution has.
# Sourced by install.sh and uninstall.sh; UNIT_DIR and TMPFILES_DIR may be set to override.
vendor_dir() {  # VARIABLE FALLBACK
    pkg-config --variable="$1" systemd 2>/dev/null | grep . || echo "$2"
}
UNIT_DIR=${UNIT_DIR:-$(vendor_dir systemdsystemunitdir /usr/lib/systemd/system)}
TMPFILES_DIR=${TMPFILES_DIR:-$(vendor_dir tmpfilesdir /usr/lib/tmpfiles.d)}
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
