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
stream = "--stream" in sys.argv[2:]
# `--exit-after CODE`: write the reply, then exit with CODE (a harness that fails on its own after an answer).
exit_code = int(sys.argv[sys.argv.index("--exit-after") + 1]) if "--exit-after" in sys.argv[2:] else 0
# `--calls N`: ask N times (a turn each), as an agent working through several steps would.
calls = int(sys.argv[sys.argv.index("--calls") + 1]) if "--calls" in sys.argv[2:] else 1
messages = [{"role": "user", "content": sys.argv[1]}]
reply = None
for turn in range(calls):
    if reply is not None:
        messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "go on"}]
    request = {"model": os.environ["GYRE_MODEL"], "max_tokens": 64, "messages": messages}
    if stream:
        with client.messages.stream(**request) as events:
            reply = events.get_final_message()
    else:
        reply = client.messages.create(**request)
text = "".join(block.text for block in reply.content if block.type == "text")
pathlib.Path("hello.txt").write_text(text + "\n")
print("wrote", len(text), "characters")
sys.exit(exit_code)
