#!/bin/bash
printf '%s\n' 'hello world' > /app/hello.txt
