"""A misbehaving device for the Flower tests: comix's ClientApp, except that the client whose
node config says ``fault=nan`` (or ``fault=extra``) corrupts its round-1 upload."""
import torch
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from comix.engines.flower import client_app as honest
from comix.engines.flower.wire import from_arrays, to_arrays

app = ClientApp()
app.query("init")(honest.init)
app.train("finish")(honest.finish)
app.evaluate()(honest.evaluate)


@app.train()
def train(msg: Message, context: Context) -> Message:
    reply = honest.train(msg, context)
    fault = context.node_config.get("fault")
    if fault and int(msg.content["round"]["round"]) == 1:
        upload = from_arrays(reply.content["upload"])
        name = sorted(upload)[0]
        if fault == "nan":
            upload[name] = torch.full_like(upload[name], float("nan"))
        else:  # an undeclared tensor: a specialist smuggled out
            upload["model.layers.0.mlp.experts.1.up_proj.lora_A"] = torch.zeros(8, 64)
        reply.content["upload"] = to_arrays(upload)
    return reply
