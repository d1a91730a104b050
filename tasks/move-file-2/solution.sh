#!/bin/bash
mkdir -p /app/backup && mv /app/data.csv /app/backup/
