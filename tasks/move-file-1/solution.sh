#!/bin/bash
mkdir -p /app/archive && mv /app/report.txt /app/archive/
