"""distributed/: process groups and collectives over torch.distributed. It sits below model/ (the
parallel layers call its collectives) and executor/ (the workers build its groups); it must never
know about models, requests or the engine.
"""
