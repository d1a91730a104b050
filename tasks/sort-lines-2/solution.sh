#!/bin/bash
LC_ALL=C sort /app/names.txt > /app/sorted.txt
