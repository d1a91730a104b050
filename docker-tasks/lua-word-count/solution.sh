#!/bin/bash
# Words are runs of letters, lowercased.
set -e
cd /app
sed -i 's/string.gmatch(text, "%S+")/string.gmatch(string.lower(text), "%a+")/' wordcount.lua
lua5.4 -e 'package.path = "/app/?.lua;" .. package.path; print(require("wordcount").count("The the, THE")["the"])'
