#!/bin/bash
set -e
cat > /app/backup.sh <<'SH'
#!/bin/bash
# Back up the text files of the data folder.
DATA_DIR=${DATA_DIR:-/app/data}
BACKUP_DIR=${BACKUP_DIR:-/app/backup}

mkdir -p "$BACKUP_DIR"
for f in "$DATA_DIR"/*.txt; do
  [ -e "$f" ] || continue
  name=$(basename "$f")
  cp "$f" "$BACKUP_DIR/$name.bak"
done
SH
chmod +x /app/backup.sh
bash /app/backup.sh
