#!/bin/bash
tr '[:lower:]' '[:upper:]' < /app/in.txt > /app/out.txt
