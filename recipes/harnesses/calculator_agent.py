"""A ReAct-style agent written only against the OpenAI client, as any harness would be: it offers a
calculator by function calling, answers each call with the tool's result, and stops at the first
turn without a call (the answer, which the task's reward scores). distflow runs it once per episode
(`task.agent=harnesses.calculator_agent:run`) and gives it the episode's base URL, key and model
name; pointed at any other OpenAI-compatible server, it runs unchanged."""

import json

import openai

from distflow.tasks.envs.calculator import Calculator

CALCULATOR = Calculator()
TOOLS = [{"type": "function", "function": {"name": CALCULATOR.name, "description": CALCULATOR.description,
                                           "parameters": CALCULATOR.parameters}}]


async def run(ctx):
    client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
    messages = list(ctx.messages)
    for _ in range(3):  # at most rollout.max_turns requests
        reply = await client.chat.completions.create(model=ctx.model, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                output = CALCULATOR(json.loads(call.function.arguments)).output
            except ValueError as e:
                output = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return None  # the reward is the task's, on the final answer
