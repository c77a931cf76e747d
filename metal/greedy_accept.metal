#include "dialect.h"
#include "greedy_accept.h"
