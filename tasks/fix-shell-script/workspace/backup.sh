#!/bin/bash
# Back up the text files of the data folder.
DATA_DIR=${DATA_DIR:-/app/data}
BACKUP_DIR=${BACKUP_DIR:-/app/backup}

for f in $(ls $DATA_DIR/*); do
  name=$(basename $f)
  cp $f $BACKUP_DIR/$name.bak
done
