#!/bin/bash
# Builds the broken repository: three commits, the last one deletes config.ini by mistake.
set -e
cd /app
export GIT_AUTHOR_NAME=Dev GIT_AUTHOR_EMAIL=dev@example.com GIT_COMMITTER_NAME=Dev GIT_COMMITTER_EMAIL=dev@example.com
export GIT_AUTHOR_DATE="2024-01-01T10:00:00Z" GIT_COMMITTER_DATE="2024-01-01T10:00:00Z"
git init -q -b main .
git config user.name Dev
git config user.email dev@example.com
printf '[server]\nport = 8080\nhost = 0.0.0.0\n\n[database]\nurl = sqlite:///app.db\npool = 4\n' > config.ini
printf 'import configparser\n\nconfig = configparser.ConfigParser()\nconfig.read("config.ini")\nprint(config["server"]["port"])\n' > app.py
git add config.ini app.py && git commit -q -m "initial application"
printf 'scratch notes\n' > notes.tmp
printf '# app\n' > README.md
git add notes.tmp README.md && git commit -q -m "add readme and notes"
git rm -q notes.tmp config.ini
printf '# app\n\nRun with: python app.py\n' > README.md
git add README.md && git commit -q -m "cleanup: remove unused files"
