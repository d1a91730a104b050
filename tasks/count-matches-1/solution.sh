#!/bin/bash
grep -c ERROR /app/log.txt > /app/count.txt
