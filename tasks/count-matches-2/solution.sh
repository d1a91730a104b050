#!/bin/bash
grep -c WARN /app/log.txt > /app/count.txt
