#!/bin/bash
printf '%s\n' 'good morning' > /app/greeting.txt
