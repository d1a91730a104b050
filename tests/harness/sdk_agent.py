"""A minimal external harness: asks the gateway (via the official anthropic SDK) and writes the reply to a file.

Run inside the sandbox by test_external_harness.py; it reads only the variables an external harness gets.
"""

import os
import pathlib
import sys

import anthropic

assert os.environ["OPENAI_BASE_URL"] == os.environ["ANTHROPIC_BASE_URL"] + "/v1"
assert os.environ["OPENAI_API_KEY"] == os.environ["ANTHROPIC_AUTH_TOKEN"]
client = anthropic.Anthropic(max_retries=0)  # base URL and bearer token from the environment
stream = len(sys.argv) > 2 and sys.argv[2] == "--stream"
request = {"model": os.environ["GYRE_MODEL"], "max_tokens": 64, "messages": [{"role": "user", "content": sys.argv[1]}]}
if stream:
    with client.messages.stream(**request) as events:
        reply = events.get_final_message()
else:
    reply = client.messages.create(**request)
text = "".join(block.text for block in reply.content if block.type == "text")
pathlib.Path("hello.txt").write_text(text + "\n")
print("wrote", len(text), "characters")
