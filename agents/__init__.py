"""kernelmill.agents"""
