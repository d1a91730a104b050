#!/bin/bash
printf '%s\n' 'gyre rocks' > /app/note.txt
