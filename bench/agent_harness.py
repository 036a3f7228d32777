"""The harness bench/agent.py measures: a multi-turn agent against the rank's endpoint, written
only against the `openai` client. Each episode makes AGENT_BENCH_TURNS requests; after each turn
a tool "runs" for AGENT_BENCH_TOOL_MS milliseconds (a sleep, as a real tool's latency) and its
result goes back as a tool-style message. The first request asks for AGENT_BENCH_N choices and the
episode goes on from the first (the others are branches: rows of their own)."""

import asyncio
import os

import openai

TURNS = int(os.environ.get("AGENT_BENCH_TURNS", "3"))
TOOL_S = float(os.environ.get("AGENT_BENCH_TOOL_MS", "20")) / 1000
CHOICES = int(os.environ.get("AGENT_BENCH_N", "1"))


async def run(ctx):
    client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    messages = list(ctx.messages)
    for turn in range(TURNS):
        reply = await client.chat.completions.create(model=ctx.model, messages=messages, n=CHOICES if turn == 0 else 1)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        if turn + 1 < TURNS:
            await asyncio.sleep(TOOL_S)
            messages.append({"role": "user", "content": f"Tool result: {ctx.seed % 97}. Go on."})
