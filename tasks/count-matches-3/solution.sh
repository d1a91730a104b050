#!/bin/bash
grep -c timeout /app/log.txt > /app/count.txt
