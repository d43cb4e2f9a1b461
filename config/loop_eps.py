# Loop-scaled residuals (Wang et al. 2026, docs/papers.md §3): each pre-norm branch is multiplied by
# eps = lambda / (R sqrt K), 1/R for the correlation of R visits and 1/sqrt(K) for depth:
# h <- h + eps f(Norm h). Their claim: with eps the best learning rate depends on K only, not on R.
# lambda is not published; 1.0 is the natural default. Composes with any pre-norm arm.
block = 'preln'
loop_lambda = 1.0
